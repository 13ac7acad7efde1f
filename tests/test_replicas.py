"""Replicas (replicas.py) on CPU: two pipelines in one Space, one compile, concurrent requests."""

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import TINY, Server, tiny_options
from gradio_client import Client
from PIL import Image

from aot import replicas


@pytest.fixture(scope="module")
def two_cpu_replicas(tmp_path_factory):
    env = {"MODEL_ID": TINY, "AOT_DEVICES": "cpu,cpu"}
    app = Server(["app.py"], env, tmp_path_factory.mktemp("replicas") / "app.log")
    yield app.wait_until_serving()
    app.stop()


def request(url: str, seed: int) -> np.ndarray:
    client = Client(url, verbose=False)
    path, used, _ = client.predict("a red cat", seed, False, 512, 768, 2, 3.5, api_name="/generate")
    assert used == seed
    return np.asarray(Image.open(path))


def test_one_compile_serves_both_replicas(two_cpu_replicas):
    log = two_cpu_replicas.text()
    assert "2 replicas on cpu, cpu; packages for 1 GPU model(s)" in log
    assert log.count("compile: FluxTransformerBlock: exported in") == 1, "the second replica compiled again"


def test_concurrent_requests_run_on_both_replicas_and_get_their_own_images(two_cpu_replicas):
    # Each seed twice at the same moment: two requests with the same image each get it whole (each
    # writes a file of its own: results.Results.write; gradio's one file per image was cut off meanwhile).
    url, seeds = two_cpu_replicas.url, [1, 2]
    alone = {seed: request(url, seed) for seed in seeds}  # one at a time
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda seed: (seed, request(url, seed)), seeds * 2))
    for seed, image in together:  # each request's seed and scheduler state stayed its own
        assert np.array_equal(image, alone[seed]), f"seed {seed}: another image when served concurrently"
    in_flight, most = set(), 0  # replicas working at once, from the log's start and end lines
    for replica, event in re.findall(r"replica (\d) (started|served)", two_cpu_replicas.text()):
        in_flight = in_flight | {replica} if event == "started" else in_flight - {replica}
        most = max(most, len(in_flight))
    assert most == 2, "the two replicas never worked at the same time"


def test_device_lists(monkeypatch):
    assert replicas.devices(tiny_options(devices="cpu,cpu")) == ["cpu", "cpu"]
    assert replicas.devices(tiny_options()) == ["cpu"]  # device=cpu named: that one
    with pytest.raises(ValueError, match="devices='gpu0': use auto or a comma-separated list of cpu, cuda, cuda:N"):
        tiny_options(devices="gpu0")

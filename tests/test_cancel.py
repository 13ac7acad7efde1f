"""A cancelled request stops at its next denoising step and writes nothing (aot/cancel.py), in the
Space's own process and in a ZeroGPU worker, and the next request is served as usual."""

import os
import re
import time
from pathlib import Path

import pytest
from conftest import TINY, Server, ZeroGPUSpace
from gradio_client import Client

from aot import cancel
from aot.results import ROOT_NAME

# The slowest request the tiny pipeline takes: seconds of work on a CPU, so a cancel lands mid-way.
SLOW = ("a red cat", 1, False, 1536, 1536, 24)


def test_a_raised_flag_reaches_a_process_forked_after_the_flags_were_made():
    with cancel.stop_flag() as index:
        reader, writer = os.pipe()
        child = os.fork()
        if child == 0:  # the child stands for a ZeroGPU worker: forked, it only reads the flag
            os.close(reader)
            deadline = time.monotonic() + 10
            while not cancel.stopped(index) and time.monotonic() < deadline:
                time.sleep(0.01)
            os.write(writer, b"1" if cancel.stopped(index) else b"0")
            os._exit(0)
        os.close(writer)
        assert not cancel.stopped(index)
        time.sleep(0.2)
        cancel._FLAGS[index] = True  # what `cancellable` does when its task is cancelled
        assert os.read(reader, 1) == b"1", "the forked process did not see the flag"
        os.waitpid(child, 0)
    with cancel.stop_flag() as again:
        assert not cancel.stopped(again), "a flag handed out again must start cleared"


def served_seconds(log: str) -> list[float]:
    return [float(s) for s in re.findall(r"served 1536x1536, 24 steps in ([\d.]+) s", log)]


@pytest.mark.parametrize("zerogpu", [False, True], ids=["own process", "zerogpu worker"])
def test_a_cancelled_request_stops_at_its_next_step_and_writes_nothing(zerogpu, tmp_path):
    cache = tmp_path / "gradio"
    env = {"MODEL_ID": TINY, "AOT_COMPILE": "0", "AOT_TEXT_FP8": "off", "GRADIO_TEMP_DIR": str(cache)}
    if zerogpu:  # the harness's device API, spaces in ZeroGPU mode, the worker computing on the CPU
        app = ZeroGPUSpace({**env, "AOT_DTYPE": "float32"}, tmp_path / "app.log", "--cpu")
    else:
        app = Server(["app.py"], env, tmp_path / "app.log")
    try:
        app.wait_until_serving()
        client = Client(app.url, verbose=False)
        start = time.monotonic()
        client.predict(*SLOW, api_name="/generate")  # how long the whole request takes here
        whole = time.monotonic() - start
        results = sorted((cache / ROOT_NAME).rglob("*.png"))
        job = client.submit(*SLOW, api_name="/generate")
        deadline = time.monotonic() + 60
        while app.text().count("replica 0 started a request") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(min(1.0, whole / 10))  # a few steps in
        # The cancel is a POST with httpx's default 5 s timeout (gradio_client reads its client's
        # httpx_kwargs when it sends it); on a loaded 2-core machine the answer once came later.
        client.httpx_kwargs["timeout"] = 60
        assert job.cancel()
        deadline = time.monotonic() + 2 * whole + 30  # a loaded machine: waiting costs nothing when it is fast
        while len(served_seconds(app.text())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(served_seconds(app.text())) == 2, app.text()[-3000:]
        first, cancelled = served_seconds(app.text())
        assert cancelled < first / 2, f"the cancelled request ran {cancelled:.1f} s of {first:.1f} s"
        assert sorted((cache / ROOT_NAME).rglob("*.png")) == results, "the cancelled request wrote its image"
        path, seed, notes = client.predict("a red cat", 2, False, 512, 512, 1, api_name="/generate")
        assert Path(path).exists() and seed == 2 and notes.startswith("512x512 px, 1 step"), notes
        if zerogpu:
            granted = re.findall(r"GPU granted for \d+ s, worker (new|reused)", app.text())
            assert granted[-1] == "reused", f"the stop cost the worker: {granted}"
    finally:
        app.stop()

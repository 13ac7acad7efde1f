"""The Space: `python app.py` on the tiny pipeline, driven over HTTP by gradio_client and in Chromium."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
from conftest import ROOT, TINY, Server
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

import app
from aot.options import Options
from aot.pipeline import load_pipeline
from aot.space import Space, image_file


@pytest.fixture(scope="module")
def running(saved, tmp_path_factory):
    """`python app.py` serving the tiny pipeline on 127.0.0.1, from the session's saved packages (a
    Space's compile at startup: test_replicas.py, and in a ZeroGPU worker test_zerogpu.py)."""
    loras = ",".join(str(ROOT / "assets" / "tiny-flux-loras" / f"{name}.safetensors") for name in "ab")
    env = {"MODEL_ID": TINY, "AOT_LORA_CHOICES": loras, "AOT_LOAD": str(saved), "AOT_STRICT": "1"}
    app = Server(["app.py"], env, tmp_path_factory.mktemp("app") / "app.log")
    yield app.wait_until_serving()
    app.stop()


@pytest.fixture(scope="module")
def server(running):
    return running.url


@pytest.fixture(scope="module")
def server_log(running):
    return running.log


@pytest.fixture(scope="module")
def client(server):
    return Client(server, verbose=False)


def generate(client, prompt="a red cat", seed=7, randomize=False, width=512, height=768, steps=2, guidance=3.5, **lora):
    """/generate as a client calls it; without `lora`, as a client written before LoRAs were offered."""
    path, seed, notes = client.predict(
        prompt, seed, randomize, width, height, steps, guidance, *lora.values(), api_name="/generate"
    )
    return np.asarray(Image.open(path)), seed, notes


def test_image_of_the_requested_size_comes_back_with_its_seed(client):
    image, seed, notes = generate(client, width=768, height=512, seed=11)
    assert image.shape == (512, 768, 3) and seed == 11
    assert notes == "768x512 px, 2 steps, seed 11."  # what was generated, for the UI and API clients


def test_the_api_names_its_inputs_and_outputs(client):
    endpoint = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/generate"]
    assert [p["parameter_name"] for p in endpoint["parameters"]] == [f.name for f in dataclasses.fields(app.Request)]
    assert [r["label"] for r in endpoint["returns"]] == ["Result", "seed", "notes"]  # were value_9, value_10


def test_same_seed_same_image_and_random_seed_is_reported(client):
    first, _, _ = generate(client, seed=3)
    second, _, _ = generate(client, seed=3)
    other, _, _ = generate(client, seed=4)
    assert np.array_equal(first, second)
    # ... in a file of its own: gradio's one file per image hash was rewritten while another request
    # of the same image downloaded it (aot.space.image_file)
    a, b = (client.predict("a red cat", 3, False, 512, 768, 2, 3.5, api_name="/generate")[0] for _ in "ab")
    assert Path(a).name != Path(b).name and Path(a).name.startswith("seed-3-")
    assert not np.array_equal(first, other)
    _, seed, _ = generate(client, seed=3, randomize=True)
    assert 0 <= seed < 2**31 and isinstance(seed, int)


def test_each_result_is_a_whole_png_of_its_own_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))  # gradio's cache folder, where it serves from
    image = Image.new("RGB", (48, 32), (200, 10, 10))
    first, second = image_file(image, 7), image_file(image, 7)
    assert first != second and Path(first).parent == Path(second).parent == tmp_path
    assert Path(first).name.startswith("seed-7-") and Path(first).suffix == ".png"
    assert np.array_equal(np.asarray(Image.open(second)), np.asarray(image))
    with pytest.raises(OSError, match="cannot write mode CMYK as PNG"):
        image_file(Image.new("CMYK", (4, 4)), 1)
    assert sorted(tmp_path.iterdir()) == sorted(map(Path, [first, second])), "a half-written file was left"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt": "   "}, "Enter a prompt"),
        ({"prompt": "\x00\x00\x00"}, r"Enter a prompt \(it has no visible character\)"),
        ({"width": 520}, r"width=520 is not allowed: use a multiple of 16 from 512 to 1536 px$"),
        ({"width": 512.5}, r"width=512\.5: use a whole number"),
        ({"height": 2048}, "Height: Value 2048 is greater than maximum value 1536"),
        ({"steps": 0}, "Steps: Value 0 is less than minimum value 1"),
        ({"guidance": 11.0}, "Guidance: Value 11.0 is greater than maximum value 10"),
        ({"seed": -1}, "Seed: Value -1 is less than minimum value 0"),
        ({"lora": "c"}, "LoRA: Value: c is not in the list of choices: \\['none', 'a', 'b'\\]"),
    ],
)
def test_invalid_request_is_refused_and_the_next_one_works(client, change, message):
    with pytest.raises(AppError, match=message):
        generate(client, **change)
    image, _, _ = generate(client)
    assert image.shape == (768, 512, 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": "four"}, r"Steps: 'four' cannot be used \(TypeError\); use a whole number from 1 to 50"),
        ({"guidance": None}, r"Guidance: None cannot be used \(TypeError\); use a number from 0 to 10"),
        ({"randomize": "yes"}, r"randomize_seed='yes': use true or false"),
    ],
)
def test_raw_api_values_are_refused_naming_the_parameter_and_what_is_allowed(client, server_log, change, message):
    before = server_log.read_text()
    with pytest.raises(AppError, match=message):
        generate(client, **change)
    added = server_log.read_text()[len(before) :]
    assert added.count("refused a request: ") == 1 and "Traceback" not in added, added
    assert generate(client)[0].shape == (768, 512, 3)


def raw_generate(server: str, values: list) -> tuple[str, str]:
    """/generate over gradio's plain HTTP API (what curl sends): the result's event and data."""
    body = json.dumps({"data": values}).encode()  # NaN goes out as the literal NaN, as from JavaScript
    start = urllib.request.Request(f"{server}gradio_api/call/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(start, timeout=30) as answer:
        event = json.loads(answer.read())["event_id"]
    with urllib.request.urlopen(f"{server}gradio_api/call/generate/{event}", timeout=300) as answer:
        lines = answer.read().decode().splitlines()
    kind = next(line.split(": ", 1)[1] for line in lines if line.startswith("event: "))
    return kind, next(line.split(": ", 1)[1] for line in lines if line.startswith("data: "))


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (1, "Seed: nan cannot be used; use a whole number from 0 to 2147483647"),
        (3, "Width: nan cannot be used; use a multiple of 16 from 512 to 1536 px"),
        (5, "Steps: nan cannot be used; use a whole number from 1 to 50"),
        (0, "The prompt holds '\\\\ud800', which is not text (a lone surrogate); send valid Unicode."),
    ],
)
def test_nan_and_broken_text_over_plain_http_are_refused_naming_the_input(server, server_log, index, message):
    values = plain_values()
    values[index] = "a red \ud800 cat" if index == 0 else float("nan")
    before = server_log.read_text()
    kind, data = raw_generate(server, values)
    assert kind == "error" and message in data, data
    added = server_log.read_text()[len(before) :]
    assert added.count("refused a request: ") == 1 and "Traceback" not in added, added
    assert raw_generate(server, plain_values())[0] == "complete"


def plain_values() -> list:
    """A plain-HTTP request's values: every field of app.Request, in order (gradio fills in no defaults there)."""
    return list(dataclasses.astuple(app.Request("a red cat", 7, False, 512, 768, 2, 3.5)))


def test_a_ten_million_character_prompt_is_refused_at_once(client, server_log):
    before, start = server_log.stat().st_size, time.monotonic()
    with pytest.raises(AppError, match=r"The prompt has 10,000,000 characters; use at most 10,000"):
        generate(client, prompt="a" * 10_000_000)
    assert time.monotonic() - start < 10
    assert server_log.stat().st_size - before < 1_000_000, "the prompt went into the log"
    assert generate(client)[0].shape == (768, 512, 3)


def test_an_upload_that_is_not_an_image_or_too_large_is_refused_without_a_server_path(client, server_log, tmp_path):
    not_image = tmp_path / "notes.png"
    not_image.write_text("this is text, not a PNG")
    bomb = tmp_path / "bomb.png"
    Image.new("1", (10_000, 10_000)).save(bomb)  # 100 megapixels in a few kB
    truncated = tmp_path / "truncated.png"
    Image.new("RGB", (64, 64), "red").save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:60])
    allowed = "use an image file \\(PNG, JPEG, WebP\\) of at most 50 MB and 64 megapixels"
    for path, why in [(not_image, "cannot be used"), (bomb, "has 100 megapixels"), (truncated, "cannot be used")]:
        before = server_log.read_text()
        with pytest.raises(AppError) as refused:
            generate(client, lora="none", image=handle_file(str(path)))
        text = str(refused.value)
        assert re.search(f"Reference image \\(optional\\): the uploaded file {why}.*; {allowed}", text), text
        assert "/tmp" not in text and str(tmp_path) not in text, "a server path in the message"
        added = server_log.read_text()[len(before) :]
        assert added.count("refused a request: ") == 1 and "Traceback" not in added, added
    assert generate(client)[0].shape == (768, 512, 3)


def test_refused_requests_log_one_line_each_and_no_traceback(client, server_log):
    before = server_log.read_text()
    for change in ({"height": 4096}, {"prompt": " "}):
        with pytest.raises(AppError):
            generate(client, **change)
    added = server_log.read_text()[len(before) :]
    assert added.count("refused a request: ") == 2, added
    assert "Traceback" not in added, added


def test_a_lora_picked_per_request_changes_the_image_and_none_brings_the_base_back(client):
    base, _, _ = generate(client)
    styled, _, notes = generate(client, lora="a")
    assert notes == "512x768 px, 2 steps, seed 7. LoRA: a."
    assert np.abs(styled.astype(float) - base).mean() > 1, "LoRA a changes the image"
    other, _, _ = generate(client, lora="b")
    assert not np.array_equal(other, styled)
    again, _, notes = generate(client, lora="none")
    assert np.array_equal(again, base) and notes == "512x768 px, 2 steps, seed 7."


def test_a_negative_prompt_to_a_model_that_takes_none_is_noted_and_changes_nothing(client):
    path, _, notes = client.predict(
        "a red cat", 7, False, 512, 768, 2, 3.5, negative_prompt="blurry", api_name="/generate"
    )
    assert notes == "512x768 px, 2 steps, seed 7. The negative prompt was not used: this FLUX.1 model takes none."
    assert np.array_equal(np.asarray(Image.open(path)), generate(client)[0])


def test_prompt_longer_than_the_text_encoder_still_generates(client):
    image, _, notes = generate(client, prompt="a very long prompt " * 40)  # > 512 T5 tokens (one per character)
    assert image.shape == (768, 512, 3)
    assert notes.endswith("The prompt is longer than 512 text tokens; the rest was ignored.")  # API clients too


def test_two_simultaneous_requests_both_complete(client, server):
    def one(seed):
        return generate(Client(server, verbose=False), seed=seed)[1]

    with ThreadPoolExecutor(2) as pool:
        assert sorted(pool.map(one, [21, 22])) == [21, 22]


def test_a_family_whose_one_step_image_is_nan_refuses_one_step_and_serves_the_next_request():
    """Qwen-Image's scheduler gives a NaN timestep for one step (tests/test_bench.py): the Space
    refuses it, saying what is allowed, and the UI's slider starts at two."""
    space = Space.start(Options(model=str(ROOT / "assets" / "tiny-qwen-image"), device="cpu", compile=False))
    request = app.Request("a red cat", width=512, height=512, num_inference_steps=1)
    with pytest.raises(gr.Error, match=r"steps=1: use a whole number from 2 to 50 \(Qwen-Image's scheduler"):
        space.generate(request)
    image, _, notes = space.generate(dataclasses.replace(request, num_inference_steps=2, negative_prompt="blurry"))
    assert image.size == (512, 512) and np.asarray(image).std() > 0  # a NaN image comes back all black
    assert "negative prompt" not in notes  # Qwen-Image takes one
    slider = next(c for c in app.ui(space).blocks.values() if getattr(c, "label", None) == "Steps")
    assert slider.minimum == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--min-side", "500"], "app.py: error: side range 500..1536 px: both ends must be multiples of 16"),
        (["--attention", "fa3"], "app.py: error: attention=fa3 cannot run: FA3 needs a CUDA GPU"),
    ],
)
def test_a_setting_that_cannot_work_stops_app_py_with_one_line(flags, message, monkeypatch, capsys):
    # app.main as `python app.py` runs it (test_options.py runs app.py itself, in a process of its own).
    monkeypatch.setenv("MODEL_ID", TINY)
    monkeypatch.setattr(sys, "argv", ["app.py", *flags])
    with pytest.raises(SystemExit) as exited:
        app.main()
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith(message), stderr[-3000:]


def test_large_model_without_cuda_names_what_it_needs(tmp_path):
    sys.path.insert(0, str(ROOT))
    from tools.bench import published_transformer

    index = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(published_transformer("flux")))
    with pytest.raises(RuntimeError, match=r"11\.9B-parameter transformer .* needs a CUDA GPU"):
        load_pipeline(Options(model=str(tmp_path), device="cpu"))


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    not chromium() and not os.environ.get("REQUIRE_BROWSER"),
    reason="no Chromium (apt-get install chromium); CI sets REQUIRE_BROWSER=1",
)
def test_browser_types_a_prompt_clicks_generate_and_sees_the_image(server, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium(),
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        page = browser.new_page(viewport={"width": 1100, "height": 1000})
        page.goto(server)
        page.get_by_label("Prompt").fill("a lighthouse at dusk")
        page.get_by_role("button", name="Generate").click()
        image = page.locator("img[src*='/file=']").first  # the result, served from gradio's cache
        expect(image).to_be_visible(timeout=120_000)
        # UPDATE_SCREENSHOT=1 refreshes the committed docs/screenshot.png.
        folder = ROOT / "docs" if os.environ.get("UPDATE_SCREENSHOT") else tmp_path
        page.screenshot(path=str(folder / "screenshot.png"), full_page=True)
        browser.close()


def test_importing_app_starts_nothing_and_the_eager_switch_serves_the_uncompiled_pipeline():
    # Before: `import app` loaded the pipeline and compiled it; tools replaced the loader to hand in their own.
    # MODEL_ID names no model while app is imported (loading it would fail: nothing may try), then the tiny one.
    code = f"""
import json, logging, os, sys
import app
from aot.options import Options
names = list(sys.modules)
logging.basicConfig(level=logging.INFO)
checks = [app.SPACE is None, names.index("spaces") < names.index("torch")]
os.environ["MODEL_ID"] = {TINY!r}
space = app.start(Options.from_env())
print(json.dumps([*checks, space.status, app.generate("a cat", 1, False, 512, 512, 1, 3.5)[1]]))
"""
    env = {**os.environ, "MODEL_ID": "no/such-model", "AOT_COMPILE": "0"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    nothing_started, spaces_first, status, seed = json.loads(done.stdout.strip().splitlines()[-1])
    assert nothing_started and done.stderr.count("startup took") == 1, done.stderr[-3000:]  # the eager start's
    assert spaces_first, "torch was imported before spaces (on ZeroGPU spaces must patch it first)"
    assert status.startswith("eager pipeline") and seed == 1

"""The Space: `python app.py` on the tiny pipeline, driven over HTTP by gradio_client and in Chromium."""

import dataclasses
import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
from conftest import ROOT, TINY, Server, free_port
from gradio.components.image import ImageData
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

import app
from aot import images
from aot.options import Options
from aot.pipeline import load_pipeline
from aot.results import Results
from aot.server import drop_truncation_warnings, guard


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


def test_the_api_names_its_inputs_and_outputs_with_the_models_defaults(client):
    endpoint = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/generate"]
    parameters = {p["parameter_name"]: p for p in endpoint["parameters"]}
    assert list(parameters) == [f.name for f in dataclasses.fields(app.Request)]
    assert [r["label"] for r in endpoint["returns"]] == ["Result", "seed", "notes"]  # were value_9, value_10
    whole = {name: parameters[name]["python_type"]["type"] for name in ("seed", "width", "height")}
    whole["num_inference_steps"] = parameters["num_inference_steps"]["python_type"]["type"]
    assert whole == dict.fromkeys(whole, "int"), whole  # were float
    defaults = {name: p["parameter_default"] for name, p in parameters.items() if name != "prompt"}
    assert defaults == {
        "seed": 0,
        "randomize_seed": True,
        "width": 1024,
        "height": 1024,
        "num_inference_steps": 28,  # FLUX.1-dev's (tiny-flux has a guidance embedding); schnell's: 4, below
        "guidance_scale": 3.5,
        "lora": "none",
        "image": None,
        "negative_prompt": "",
    }, defaults


def test_same_seed_same_image_and_random_seed_is_reported(client):
    first, _, _ = generate(client, seed=3)
    second, _, _ = generate(client, seed=3)
    other, _, _ = generate(client, seed=4)
    assert np.array_equal(first, second)
    # ... in a file of its own: gradio's one file per image hash was rewritten while another request
    # of the same image downloaded it (aot.results.Results.write)
    a, b = (client.predict("a red cat", 3, False, 512, 768, 2, 3.5, api_name="/generate")[0] for _ in "ab")
    assert Path(a).name != Path(b).name and Path(a).name.startswith("seed-3-")
    assert not np.array_equal(first, other)
    _, seed, _ = generate(client, seed=3, randomize=True)
    assert 0 <= seed < 2**31 and isinstance(seed, int)


def test_each_result_is_a_whole_png_of_its_own_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))  # gradio's cache folder, where it serves from
    results = Results(3600)
    image = Image.new("RGB", (48, 32), (200, 10, 10))
    first, second = results.write(image, 7), results.write(image, 7)
    assert first != second and Path(first).parent == Path(second).parent == results.folder
    assert results.folder.parent.parent == tmp_path
    assert Path(first).name.startswith("seed-7-") and Path(first).suffix == ".png"
    assert np.array_equal(np.asarray(Image.open(second)), np.asarray(image))
    with pytest.raises(OSError, match="cannot write mode CMYK as PNG"):
        results.write(Image.new("CMYK", (4, 4)), 1)
    written = sorted(p.name for p in results.folder.iterdir() if p.name != ".lock")
    assert written == sorted(Path(p).name for p in (first, second)), "a half-written file was left"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt": "   "}, r"^Prompt: it has no visible character; describe what to generate\.$"),
        ({"prompt": "\x00\x00\x00"}, r"^Prompt: it has no visible character; describe what to generate\.$"),
        ({"width": 520}, r"^Width: 520 is not a multiple of 16; use a multiple of 16 from 512 to 1536 px\.$"),
        ({"width": 512.5}, r"^Width: 512\.5 is not a whole number; use a multiple of 16 from 512 to 1536 px\.$"),
        ({"height": 2048}, r"^Height: 2048 is above 1536; use a multiple of 16 from 512 to 1536 px\.$"),
        ({"steps": 0}, r"^Steps: 0 is below 1; use a whole number from 1 to 50\.$"),
        ({"guidance": 11.0}, r"^Guidance: 11\.0 is above 10; use a number from 0 to 10\.$"),
        ({"seed": -1}, r"^Seed: -1 is below 0; use a whole number from 0 to 2147483647\.$"),
        ({"seed": 2**40}, r"^Seed: 1099511627776 is above 2147483647; use a whole number from 0 to 2147483647\.$"),
        ({"lora": "c"}, r"^LoRA: 'c' is not offered; use one of none, a, b\.$"),
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
        ({"steps": "four"}, r"^Steps: 'four' is not a number; use a whole number from 1 to 50\.$"),
        ({"guidance": None}, r"^Guidance: None is not a number; use a number from 0 to 10\.$"),
        ({"randomize": "yes"}, r"^Randomize seed: 'yes' is not true or false; use true or false\.$"),
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
    # the stream's last event is the result; heartbeats come before it while a request runs long
    events = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    return events[-1], [line.split(": ", 1)[1] for line in lines if line.startswith("data: ")][-1]


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (1, "Seed: nan is not a number; use a whole number from 0 to 2147483647."),
        (3, "Width: nan is not a number; use a multiple of 16 from 512 to 1536 px."),
        (5, "Steps: nan is not a number; use a whole number from 1 to 50."),
        (0, "Prompt: it holds '\\\\ud800', which is not text (a lone surrogate); send valid Unicode."),
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
    """A plain-HTTP request's values: every field of app.Request, in order."""
    return ["a red cat", 7, False, 512, 768, 2, 3.5, "none", None, ""]


def test_a_short_plain_http_call_gets_the_defaults_and_an_empty_one_is_told_what_to_send(server, server_log):
    kind, data = raw_generate(server, ["a red cat"])  # only the prompt: the widgets' values for the rest
    assert kind == "complete" and "1024x1024 px, 28 steps" in data, data
    kind, data = raw_generate(server, plain_values()[:9])  # a client written before the negative prompt
    assert kind == "complete" and "512x768 px, 2 steps, seed 7." in data, data
    before = server_log.read_text()
    kind, data = raw_generate(server, [])
    names = ", ".join(f.name for f in dataclasses.fields(app.Request))
    assert kind == "error" and f"Prompt: missing; send the inputs in this order: {names}" in data, data
    assert "gradio.components" not in data and "/tmp" not in data, data
    added = server_log.read_text()[len(before) :]
    assert added.count("refused a request: ") == 1 and "Traceback" not in added, added


@pytest.fixture(scope="module")
def schnell(saved, tmp_path_factory):
    """tiny-flux-schnell served from tiny-flux's packages (its blocks are the same; it has no guidance)."""
    env = {"MODEL_ID": str(ROOT / "assets" / "tiny-flux-schnell"), "AOT_LOAD": str(saved), "AOT_STRICT": "1"}
    app = Server(["app.py"], env, tmp_path_factory.mktemp("schnell") / "app.log")
    yield app.wait_until_serving()
    app.stop()


def test_a_prompt_only_call_gets_the_models_own_defaults_through_the_client_and_plain_http(schnell):
    _, _, notes = Client(schnell.url, verbose=False).predict("a red fox", api_name="/generate")
    assert notes.startswith("1024x1024 px, 4 steps, seed "), notes  # FLUX.1-schnell's 4 steps, not dev's 28
    kind, data = raw_generate(schnell.url, ["a red fox"])
    assert kind == "complete" and "1024x1024 px, 4 steps, seed " in data, data
    assert "Guidance" not in notes, "schnell takes no guidance: its default leaves nothing to note"
    values = plain_values()
    values[7] = "nope"
    kind, data = raw_generate(schnell.url, values)
    assert kind == "error" and "LoRA: 'nope' is not offered; use none: no LoRA is offered." in data, data


def test_a_ten_million_character_prompt_is_refused_at_once(client, server_log):
    before, start = server_log.stat().st_size, time.monotonic()
    with pytest.raises(AppError, match=r"Prompt: it has 10,000,000 characters; use at most 10,000"):
        generate(client, prompt="a" * 10_000_000)
    assert time.monotonic() - start < 10
    assert server_log.stat().st_size - before < 1_000_000, "the prompt went into the log"
    assert generate(client)[0].shape == (768, 512, 3)


def test_an_upload_to_a_text_to_image_model_is_refused_for_that_first(client, server_log, tmp_path):
    # tiny-flux takes no image: whatever the file is (here not even an image), that is what is said.
    not_image = tmp_path / "notes.png"
    not_image.write_text("this is text, not a PNG")
    before = server_log.read_text()
    with pytest.raises(AppError) as refused:
        generate(client, lora="none", image=handle_file(str(not_image)))
    assert str(refused.value) == "Input image: FLUX.1 generates from text only; leave it empty.", refused.value
    added = server_log.read_text()[len(before) :]
    assert added.count("refused a request: ") == 1 and "Traceback" not in added, added
    assert generate(client)[0].shape == (768, 512, 3)


def uploaded(path: Path) -> ImageData:
    """An upload's payload, as gradio hands it to the image widget's preprocessing."""
    return ImageData(path=str(path), orig_name=path.name)


def test_an_upload_that_is_not_an_accepted_image_is_refused_in_one_line_without_a_server_path(tmp_path):
    # The image widget of a model that takes one (guard; a text-to-image model refuses any upload first).
    widget = guard(gr.Image(label="Input image", type="pil", image_mode=None), images.ALLOWED)
    files = {"notes.png": "is not an image", "bomb.png": "has 100 megapixels", "truncated.png": "cannot be read"}
    files["scan.tiff"] = "is a TIFF file"
    (tmp_path / "notes.png").write_text("this is text, not a PNG")
    Image.new("1", (10_000, 10_000)).save(tmp_path / "bomb.png")  # 100 megapixels in a few kB
    Image.new("RGB", (64, 64), "red").save(tmp_path / "truncated.png")
    (tmp_path / "truncated.png").write_bytes((tmp_path / "truncated.png").read_bytes()[:60])
    Image.new("F", (64, 64), 0.5).save(tmp_path / "scan.tiff")  # TIFF: not one of the formats named
    for name, why in files.items():
        with pytest.raises(gr.Error) as refused:
            widget.preprocess(uploaded(tmp_path / name))
        text = refused.value.message
        assert text.startswith(f"Input image: the uploaded file {why}"), text
        assert text.endswith("; use an image file (PNG, JPEG, WebP) of at most 50 MB and 64 megapixels."), text
        assert str(tmp_path) not in text and "/tmp" not in text, "a server path in the message"
    Image.new("RGBA", (40, 30), (255, 0, 0, 128)).save(tmp_path / "fine.png")
    assert widget.preprocess(uploaded(tmp_path / "fine.png")).mode == "RGBA"  # as it is: `prepare` converts it


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
    server = app.start(Options(model=str(ROOT / "assets" / "tiny-qwen-image"), device="cpu", compile=False))
    request = server.fill(app.Request("a red cat", width=512, height=512, num_inference_steps=1))
    with pytest.raises(gr.Error, match=r"Steps: 1 is below 2; use a whole number from 2 to 50 \(Qwen-Image's sched"):
        server.prepare(request)
    request, seed, notes = server.prepare(dataclasses.replace(request, num_inference_steps=2, negative_prompt="blurry"))
    image = server.infer(0, request, seed)
    assert image.size == (512, 512) and np.asarray(image).std() > 0  # a NaN image comes back all black
    assert "negative prompt" not in notes  # Qwen-Image takes one
    slider = next(c for c in app.ui(server).blocks.values() if getattr(c, "label", None) == "Steps")
    assert slider.minimum == 2 and slider.value == 50  # Qwen-Image's default steps


def handler(demo: gr.Blocks, inputs: list, outputs: list):
    """The function of `demo`'s event that reads `inputs` and writes `outputs` (gradio's own wiring)."""
    ids = lambda blocks: [b._id for b in blocks]  # noqa: E731
    return next(f.fn for f in demo.fns.values() if ids(f.inputs) == ids(inputs) and ids(f.outputs) == ids(outputs))


def widget(demo: gr.Blocks, label: str):
    return next(c for c in demo.blocks.values() if getattr(c, "label", None) == label)


def test_an_edit_models_size_sliders_follow_an_upload_and_the_last_seed_can_be_reused():
    server = app.start(Options(model=str(ROOT / "assets" / "tiny-flux-kontext"), device="cpu", compile=False))
    demo = app.ui(server)
    image, width, height = widget(demo, "Input image"), widget(demo, "Width"), widget(demo, "Height")
    follow = handler(demo, [image], [width, height])
    w, h = follow(Image.new("RGB", (1000, 700)))
    assert (w % 16, h % 16) == (0, 0) and abs(w / h / (1000 / 700) - 1) < 0.03, (w, h)
    assert abs(w * h / 1024**2 - 1) < 0.05, "about as many pixels as the default size"
    seed, randomize = widget(demo, "Seed"), widget(demo, "Randomize seed")
    reuse = handler(demo, [widget(demo, "seed")], [seed, randomize])
    assert reuse(123456) == (123456, False)  # the seed the last image was made with, kept from now on
    examples = [c for c in demo.blocks.values() if isinstance(c, gr.Dataset)]
    assert any("example.png" in str(sample) for dataset in examples for sample in dataset.samples)


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
    monkeypatch.setenv("GRADIO_SERVER_PORT", str(free_port()))
    monkeypatch.setattr(sys, "argv", ["app.py", *flags])
    with pytest.raises(SystemExit) as exited:
        app.main()
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith(message), stderr[-3000:]


def test_a_taken_port_or_an_unwritable_cache_stops_app_py_before_anything_loads(tmp_path):
    # Before: gradio moved to the next port without a word (a Space's health check then fails), and
    # an unwritable GRADIO_TEMP_DIR gave a 41-line traceback at launch, after the whole startup.
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = {
            f"port {port} on 127.0.0.1 is taken by another process: stop it, or set GRADIO_SERVER_PORT to a free "
            "port": {"GRADIO_SERVER_PORT": str(port)},
            f"gradio's cache folder {blocked}/gradio is not writable (Not a directory): results and uploads go "
            "there; set GRADIO_TEMP_DIR to a writable folder": {"GRADIO_TEMP_DIR": str(blocked / "gradio")},
        }
        for message, env in cases.items():
            env = {"GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(free_port()), **env}
            started = time.monotonic()
            done = subprocess.run(
                [sys.executable, "app.py"],
                cwd=ROOT,
                env={**os.environ, "MODEL_ID": TINY, **env},
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
            assert done.stderr.strip().splitlines()[-1] == f"app.py: error: {message}", done.stderr[-3000:]
            assert "Loading pipeline components" not in done.stderr, "the pipeline was loaded first"
            assert time.monotonic() - started < 60


def test_a_save_that_fills_the_disk_is_a_warning_and_the_space_serves(saved, tmp_path, monkeypatch, caplog):
    # Before: AOT_SAVE on a full disk ended app.py with "[Errno 28] No space left on device" after the
    # whole startup: no path named, the packages lost, nothing served. A writer that raises ENOSPC
    # stands in for the full disk (no tmpfs can be mounted here).
    from aot import saving

    def full_disk(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saving, "_write", full_disk)
    target = tmp_path / "packages"
    with caplog.at_level(logging.WARNING, logger="app"):
        server = app.start(Options(model=TINY, device="cpu", load=str(saved), save=str(target)))
    said = f"packages not saved to {target} ([Errno 28] No space left on device); serving them anyway"
    assert said in caplog.text, caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [".packages.lock"], "a half-written save was left"
    request = app.Request("a red cat", seed=1, randomize_seed=False, width=512, height=512, num_inference_steps=1)
    request, seed, _ = server.prepare(server.fill(request))
    assert server.infer(0, request, seed).size == (512, 512)


def test_a_long_prompts_cut_text_stays_out_of_the_log_and_the_notes_say_it_was_cut():
    # Before: diffusers' truncation warning quoted the cut text of every long prompt (about 6.5 KB
    # each, 1 MB of log per 400 requests), though the request's notes already said it was cut.
    server = app.start(Options(model=TINY, device="cpu", compile=False))
    pipeline_log = logging.getLogger(type(server.replicas.pipes[0]).__module__)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    prompt = " ".join(f"word{i}" for i in range(600))
    request = app.Request(prompt, seed=1, randomize_seed=False, width=512, height=512, num_inference_steps=1)
    request, seed, notes = server.prepare(server.fill(request))
    assert "The prompt is longer than 512 text tokens; the rest was ignored." in notes
    pipeline_log.addHandler(handler)
    try:
        server.infer(0, request, seed)
        assert records == [], [r.getMessage()[:200] for r in records]
        pipeline_log.removeFilter(drop_truncation_warnings)  # what the log got before
        server.infer(0, request, seed)
    finally:
        pipeline_log.removeHandler(handler)
        pipeline_log.addFilter(drop_truncation_warnings)
    assert any("word599" in r.getMessage() for r in records), "the stand-in for 'before' logged no cut text"


def test_a_local_folder_that_is_not_there_or_holds_no_pipeline_is_named_with_the_tiny_pipelines(monkeypatch):
    # A typo under a folder that exists is a missing folder, not an unreachable Hub repo.
    monkeypatch.chdir(ROOT)
    with pytest.raises(RuntimeError, match="cannot load 'assets/nonexistent': there is no such folder") as refused:
        load_pipeline(Options(model="assets/nonexistent", device="cpu"))
    assert "assets/tiny-flux, " in str(refused.value) and "Hub" not in str(refused.value), refused.value
    # A folder that is there but holds no pipeline (LoRA files) is told so, without the Hub's advice.
    with pytest.raises(RuntimeError, match="Give a folder that holds a diffusers pipeline") as refused:
        load_pipeline(Options(model="assets/tiny-flux-loras", device="cpu"))
    assert "Offline" not in str(refused.value), refused.value


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
checks = [app.SERVER is None, names.index("spaces") < names.index("torch")]
os.environ["MODEL_ID"] = {TINY!r}
server = app.start(app.read_options([]))
print(json.dumps([*checks, server.status, app.run(("a cat", 1, False, 512, 512, 1), -1)[1]]))
"""
    env = {**os.environ, "MODEL_ID": "no/such-model", "AOT_COMPILE": "0"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    nothing_started, spaces_first, status, seed = json.loads(done.stdout.strip().splitlines()[-1])
    assert nothing_started and done.stderr.count("startup took") == 1, done.stderr[-3000:]  # the eager start's
    assert spaces_first, "torch was imported before spaces (on ZeroGPU spaces must patch it first)"
    assert status.startswith("eager pipeline") and seed == 1

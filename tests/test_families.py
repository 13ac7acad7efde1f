"""Every family's tiny pipeline (assets/tiny-*/, families.py): compiled vs eager at three sizes, the
Space serving it through gradio_client, and a clear refusal for pipelines that are not supported.

Each family is compiled once per session for sides 256..512 (small sizes keep the CPU compiles
short) and its packages saved; they load (strict) into a fresh pipeline that must match eager
too. The Space starts from those packages (AOT_LOAD, strict) for one family per path of the
Space that depends on the family (`SERVED`), so each family costs one compile and at most one
quick app start.
"""

import dataclasses
import inspect
import json
import urllib.request

import numpy as np
import pytest
import torch
from conftest import ROOT, TOLERANCE, Server, decided, optimize
from gradio_client import Client, handle_file
from PIL import Image

from aot.apply import patch_blocks_
from aot.blocks import rel_error, repeated_blocks
from aot.contract import contract_from_captures
from aot.families import FAMILIES, CaptureRequest, family
from aot.model_config import latent_channels, with_latent_channels
from aot.options import Options
from aot.pipeline import load_pipeline
from aot.resolution import Resolution


def pipeline_class(folder: str) -> str:
    return json.loads((ROOT / "assets" / folder / "model_index.json").read_text())["_class_name"]


TINY = sorted(p.parent.name for p in (ROOT / "assets").glob("tiny-*/model_index.json"))
# Supported families; FLUX.1 has its own tests: tiny-flux (dev) in test_compile.py and test_app.py,
# tiny-flux-schnell (no guidance embedding, outside the blocks) with tiny-flux's packages below.
FOLDERS = [
    pytest.param(f, marks=pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}"))
    for f in TINY
    if pipeline_class(f) in FAMILIES and pipeline_class(f) != "FluxPipeline"
    for missing in [FAMILIES[pipeline_class(f)].missing()]
]
# The Space's paths that depend on the family (server.py, app.ui), each served once: an optional
# reference image and a model that takes no guidance (FLUX.2 klein), a negative prompt (Qwen-Image),
# a required input image (Kontext) and a prompt that is not cut (Qwen-Image-Edit). tiny-flux (guided, text
# only) is served by test_app.py; the other families differ from these in the pipeline call, which
# their compiled and loaded pipelines run here in-process.
SERVED_FOLDERS = ("tiny-flux2-klein", "tiny-flux-kontext", "tiny-qwen-image", "tiny-qwen-image-edit")
SERVED = [f for f in FOLDERS if f.values[0] in SERVED_FOLDERS]
SIDES = {"min_side": 256, "max_side": 512}
SIZES = [(256, 256), (512, 512), (256, 512)]


def options(folder: str, **changes) -> Options:
    return Options(model=str(ROOT / "assets" / folder), device="cpu", **SIDES, **changes)


def input_image() -> Image.Image:
    """An input image for the edit families, of another size than any output (the app resizes it)."""
    pixels = np.indices((200, 300)).sum(axis=0) % 256
    return Image.fromarray(np.stack([pixels, 255 - pixels, pixels // 2], axis=-1).astype(np.uint8))


def images(
    pipe, height: int, width: int, steps: int = 2, prompt: str = "a red cat on a mat", reference: bool = False
) -> torch.Tensor:
    row = family(type(pipe).__name__)
    image = input_image() if row.image_input == "required" or reference else None
    call = row.call(pipe, CaptureRequest(prompt, height, width, steps, row.defaults(pipe)[1], image))
    return pipe(**call, generator=torch.Generator().manual_seed(0), output_type="pt").images


@pytest.fixture(scope="session")
def compiled_families(tmp_path_factory):
    """folder -> (compiled pipeline, packages folder): each family compiled once, on first use."""
    cache = {}

    def get(folder: str):
        if folder not in cache:
            packages = tmp_path_factory.mktemp(folder) / "packages"
            pipe = load_pipeline(options(folder))
            optimize(pipe, options(folder, save=str(packages)))
            cache[folder] = pipe, packages
        return cache[folder]

    return get


@pytest.mark.parametrize("folder", FOLDERS)
def test_compiled_family_matches_eager_at_both_ends_and_non_square(folder, compiled_families):
    compiled, packages = compiled_families(folder)
    eager = load_pipeline(options(folder))
    row = family(pipeline_class(folder))
    calls = [(height, width, {}) for height, width in SIZES]
    if row.text_rule == "prompt":  # a text length other than the captured ones
        calls.append((256, 512, {"prompt": "a long prompt about a red cat on a mat by the window " * 5}))
    if row.image_input == "optional":  # captured without one: twice the image tokens
        calls += [(height, width, {"reference": True}) for height, width in SIZES[1:]]
    for height, width, extra in calls:
        expected = images(eager, height, width, **extra)
        actual = images(compiled, height, width, **extra)
        assert actual.shape == (1, 3, height, width)
        error = rel_error(actual, expected)
        assert error < TOLERANCE, f"{folder} {height}x{width} {list(extra)}: rel. error {error:.2e}"
    # What a Space started from the saved packages runs (the Space itself: SERVED families only): they
    # load, strict, into a fresh pipeline, which must match eager in the last call, the furthest from the captures.
    loaded = load_pipeline(options(folder))
    assert optimize(loaded, options(folder, load=str(packages), strict=True)).source == f"loaded from {packages}"
    error = rel_error(images(loaded, height, width, **extra), expected)
    assert error < TOLERANCE, f"{folder} loaded {height}x{width} {list(extra)}: rel. error {error:.2e}"


@pytest.mark.parametrize("folder", SERVED)
def test_space_serves_the_family_from_its_saved_packages(folder, compiled_families, tmp_path):
    pipe, packages = compiled_families(folder)
    env = {
        "MODEL_ID": str(ROOT / "assets" / folder),
        "AOT_LOAD": str(packages),
        "AOT_STRICT": "1",
        "AOT_MIN_SIDE": "256",
        "AOT_MAX_SIDE": "512",
    }
    app = Server(["app.py"], env, tmp_path / "app.log").wait_until_serving()
    try:
        client = Client(app.url, verbose=False)
        row = family(pipeline_class(folder))
        args = ["a red cat", 5, False, 384, 256, 2, row.guidance]
        if row.image_input == "required":
            image_path = tmp_path / "input.png"
            input_image().save(image_path)
            with pytest.raises(Exception, match=f"Input image: missing; upload the image to edit: {row.label} edits"):
                client.predict(*args, api_name="/generate")
            args += ["none", handle_file(str(image_path))]  # no LoRA, the input image
        if not row.truncates:  # Qwen-Image-Edit: a prompt past the compiled text length is refused up front
            with pytest.raises(Exception, match=rf"Prompt: it has \d+ text tokens; {row.label} takes at most 512"):
                client.predict("a red cat " * 300, *args[1:], api_name="/generate")
        path, seed, notes = client.predict(*args, api_name="/generate")  # text-only clients omit the image
        assert np.asarray(Image.open(path)).shape == (256, 384, 3) and seed == 5
        # What the request did not get as asked is in the notes: unused guidance, a resized input image.
        unused = f"Guidance {row.guidance:g} was not used"
        assert (unused in notes) == (not row.guided(pipe) and row.guidance != 0), notes
        fitted = "The input image (300x200) was resized to 384x256"  # the same aspect ratio: nothing to crop
        assert (fitted in notes) == (row.image_input == "required"), notes
        with urllib.request.urlopen(f"{app.url}config", timeout=30) as answer:  # the page's examples
            components = json.load(answer)["components"]
        samples = str([c["props"].get("samples") for c in components if c["type"] == "dataset"])
        assert ("turn it into a watercolor painting" in samples) == (row.image_input == "required"), samples
        assert ("example.png" in samples) == (row.image_input == "required"), "an edit example without its image"
        if row.image_input == "required":  # default size: the output follows the input image's aspect ratio
            photo = tmp_path / "photo.png"
            Image.new("RGB", (1000, 700), (90, 140, 200)).save(photo)
            path, _, notes = client.predict("a red cat", image=handle_file(str(photo)), api_name="/generate")
            height, width = np.asarray(Image.open(path)).shape[:2]
            assert abs(width / height / (1000 / 700) - 1) < 0.03, (width, height, notes)
            assert "follows the input image's aspect ratio" in notes and "stretch" not in notes, notes
        if row.image_input == "optional":
            image_path = tmp_path / "reference.png"
            input_image().save(image_path)
            path, _, _ = client.predict(*args, "none", handle_file(str(image_path)), api_name="/generate")
            assert np.asarray(Image.open(path)).shape == (256, 384, 3)
        negative = [c for c in components if c["props"].get("label") == "Negative prompt"]
        assert negative and negative[0]["props"]["visible"] == ("negative_prompt" in row.controls), negative
        if "negative_prompt" in row.controls:  # Chroma, Qwen-Image: the pipeline gets it (true CFG)
            other, _, _ = client.predict(*args, negative_prompt="blurry, low quality", api_name="/generate")
            again, _, _ = client.predict(*args, api_name="/generate")  # the same seed repeats exactly
            assert np.array_equal(np.asarray(Image.open(again)), np.asarray(Image.open(path)))
            assert not np.array_equal(np.asarray(Image.open(other)), np.asarray(Image.open(path)))
            with pytest.raises(Exception, match="Negative prompt: it has 10,001 characters; use at most 10,000"):
                client.predict(*args, negative_prompt="x" * 10_001, api_name="/generate")
        assert "AoT loaded from" in app.text(), "the Space compiled instead of loading the saved packages"
    finally:
        app.stop()


def test_flux1_packages_serve_the_checkpoint_without_guidance_too(compiled):
    # tiny-flux-schnell is tiny-flux's row and blocks without the guidance embedding, which is outside
    # the blocks: the weights-less packages compiled for tiny-flux (conftest) run it, as a compile of its
    # own would (the same captures and contract; only the pipeline call leaves guidance out).
    schnell = Options(model=str(ROOT / "assets" / "tiny-flux-schnell"), device="cpu")
    eager, pipe = load_pipeline(schnell), load_pipeline(schnell)
    assert not family("FluxPipeline").guided(pipe)
    patch_blocks_(pipe, compiled)
    for height, width in [(512, 512), (768, 1344)]:
        error = rel_error(images(pipe, height, width), images(eager, height, width))
        assert error < TOLERANCE, f"tiny-flux-schnell {height}x{width}: rel. error {error:.2e}"


@pytest.mark.parametrize(
    ("pipeline", "why"),
    [
        ("WanPipeline", "video"),
        ("LTXPipeline", "video"),
        ("StableDiffusion3Pipeline", "no `_repeated_blocks`"),
        ("SanaPipeline", "no `_repeated_blocks`"),
        ("KandinskyPipeline", "no row in families.py"),
    ],
)
def test_unsupported_pipeline_is_refused_at_startup_naming_what_is_supported(pipeline, why, tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    with pytest.raises(ValueError, match=rf"{pipeline} is not supported: .*{why}.*Supported pipelines: FLUX\.1"):
        load_pipeline(Options(model=str(tmp_path), device="cpu"))


def test_family_whose_pipeline_needs_a_missing_module_says_which_at_startup(monkeypatch):
    # A test-only stand-in: every module a row requires is installed here (requirements.txt), so
    # the FLUX.2 row is made to require one that no machine has.
    row = FAMILIES["Flux2Pipeline"]
    monkeypatch.setitem(FAMILIES, "Flux2Pipeline", dataclasses.replace(row, requires=("no_such_module",)))
    with pytest.raises(RuntimeError, match=r"needs no_such_module, which is not installed: pip install"):
        load_pipeline(Options(model=str(ROOT / "assets" / "tiny-flux2"), device="cpu"))


def test_blocks_of_one_class_get_a_package_per_container_and_weight_layout():
    # Z-Image: ZImageTransformerBlocks in three containers; the context refiner's have no modulation.
    from diffusers import ZImageTransformer2DModel

    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=3,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=16,
        axes_dims=[4, 6, 6],
        axes_lens=[64, 64, 64],
    )
    groups = repeated_blocks(transformer)
    assert {name: len(blocks) for name, blocks in groups.items()} == {
        "ZImageTransformerBlock-noise_refiner": 1,
        "ZImageTransformerBlock-context_refiner": 1,
        "ZImageTransformerBlock-layers": 3,
    }
    assert [block.modulation for block in groups["ZImageTransformerBlock-context_refiner"]] == [False]
    assert all(block.modulation for block in groups["ZImageTransformerBlock-layers"])


def test_text_length_that_follows_the_prompt_is_a_checked_dynamic_dimension():
    # Qwen-Image's block inputs: image and text tokens in separate tensors, the rotary tables too.
    def inputs(image, text):
        return {"x": torch.zeros(1, image, 8), "text": torch.zeros(1, text, 8), "text_rope": torch.zeros(text, 4)}

    resolution = Resolution(256, 512)
    points = [(256, 14), (1024, 14), (256, 83)]
    calls = [((), inputs(*point)) for point in points]
    contract = contract_from_captures("Block", calls, points, resolution, (256, 1024), (2, 512))
    assert [(s.path, s.shape, s.image, s.text) for s in contract.tensors] == [
        ("x", (1, None, 8), (0, 1, 0), (0, 0, 0)),
        ("text", (1, None, 8), (0, 0, 0), (0, 1, 0)),
        ("text_rope", (None, 4), (0, 0), (1, 0)),
    ]
    contract.check_inputs(inputs(512, 300))
    with pytest.raises(ValueError, match=r"compiled for 2\.\.512 text tokens; text has 600"):
        contract.check_inputs(inputs(512, 600))
    with pytest.raises(ValueError, match="text_rope has 20 text tokens while other inputs of this call have 300"):
        contract.check_inputs({**inputs(512, 300), "text_rope": torch.zeros(20, 4)})


def test_a_dim_that_follows_image_and_text_is_its_own_checked_dimension():
    # Z-Image's main blocks: image and text tokens in one sequence (here beside image-only and text-only inputs).
    def inputs(image, text):
        x, rope = torch.zeros(1, image + text, 8), torch.zeros(image + text + 1, 4)
        return {"x": x, "rope": rope, "image": torch.zeros(image), "text": torch.zeros(text)}

    points = [(256, 32), (1024, 32), (256, 96)]
    contract = contract_from_captures(
        "Block", [((), inputs(*p)) for p in points], points, Resolution(256, 512), (256, 1024), (32, 512)
    )
    assert [(s.shape, s.offsets, s.image, s.text) for s in contract.tensors] == [
        ((1, None, 8), (0, 0, 0), (0, 1, 0), (0, 1, 0)),
        ((None, 4), (1, 0), (1, 0), (1, 0)),
        ((None,), (0,), (1,), (0,)),
        ((None,), (0,), (0,), (1,)),
    ]
    contract.check_inputs(inputs(512, 64))
    with pytest.raises(ValueError, match=r"a dim of 1\*I \+ 1\*L is 600, but I = 512 and L = 64"):
        contract.check_inputs({**inputs(512, 64), "x": torch.zeros(1, 600, 8), "rope": torch.zeros(601, 4)})
    with pytest.raises(ValueError, match=r"compiled for 288\.\.1536 tokens = 1\*image \+ 1\*text; x has 2000"):
        contract.check_inputs(inputs(1900, 100))
    # A dim that doubles with the prompt's tokens plus one is not a whole multiple plus a constant.
    odd = [((), {"x": torch.zeros(t * 3 // 2)}) for _, t in points]
    with pytest.raises(ValueError, match="not a whole multiple of the text tokens plus a constant"):
        contract_from_captures("Block", odd, points, Resolution(256, 512), (256, 1024), (32, 512))


def test_a_compile_captures_a_longer_prompt_only_where_the_text_length_follows_the_prompt():
    sizes = [(1024, 1024), (256, 256)]
    for row in FAMILIES.values():
        calls = row.captures(sizes, "short", "long")
        assert calls[:2] == [(size, "short") for size in sizes]
        assert calls[2:] == ([((1024, 1024), "long")] if row.text_range else [])
        assert row.capture_references == (row.image_input == "required")


def test_a_package_is_tried_on_every_captured_shape_not_only_the_one_it_was_exported_on(monkeypatch):
    """cuBLAS refused Qwen-Image's row-wise FP8 at its shortest text and not at 1.4k tokens
    (BENCHMARKS.md), so a trial at one shape says nothing of another: each compiled block runs on
    every captured call (both image sizes; the short and the long prompt), against its eager block."""
    from aot import export

    shapes, bind = [], export.bind

    def recording_bind(package, block):  # the real runner, its calls' hidden-state shapes recorded
        runner, constants = bind(package, block)

        def run(**kwargs):
            shapes.append((tuple(kwargs["hidden_states"].shape), tuple(kwargs["encoder_hidden_states"].shape)))
            return runner(**kwargs)

        return run, constants

    monkeypatch.setattr(export, "bind", recording_bind)
    folder = "tiny-qwen-image"
    pipe = load_pipeline(options(folder))
    compiled = export.compile_blocks(*decided(pipe, options(folder, fp8="off")))
    image_tokens = {h[1] for h, _ in shapes}
    text_tokens = {t[1] for _, t in shapes}
    assert len(shapes) == 3 and len(image_tokens) == 2 and len(text_tokens) == 2
    assert compiled.packages["QwenImageTransformerBlock"].rel_error <= export.MAX_REL_ERROR


@pytest.mark.parametrize("folder", [f for f in TINY if pipeline_class(f) in FAMILIES])
def test_a_row_names_fields_and_inputs_its_published_transformer_has(folder):
    # tools/bench.py sizes a family's published transformer by the config fields its row names: a
    # misspelt field would add a key instead of setting one, a misspelt input would widen nothing.
    import diffusers

    from tools.bench import published_transformer

    row = family(pipeline_class(folder))
    config = published_transformer(folder.removeprefix("tiny-"))
    named = [*row.layer_fields, *row.head_fields, *row.text_widths.values(), *filter(None, [row.width_field])]
    assert [name for name in named if name not in config] == []
    index = json.loads((ROOT / "assets" / folder / "model_index.json").read_text())
    forward = getattr(diffusers, index["transformer"][1]).forward
    assert row.text_widths.keys() <= inspect.signature(forward).parameters.keys()


def test_a_vae_config_for_other_latent_channels_keeps_one_statistic_per_channel():
    qwen = {"z_dim": 4, "latents_mean": [0.1, 0.2, 0.3, 0.4], "latents_std": [1.0] * 4}
    assert latent_channels(qwen) == 4
    wider = {"z_dim": 6, "latents_mean": [0.1, 0.2, 0.3, 0.4, 0.1, 0.2], "latents_std": [1.0] * 6}
    assert with_latent_channels(qwen, 6) == wider and latent_channels(qwen) == 4
    assert with_latent_channels(qwen, 2) == {"z_dim": 2, "latents_mean": [0.1, 0.2], "latents_std": [1.0] * 2}
    flux = {"latent_channels": 16, "latents_mean": None}
    assert latent_channels(flux) == 16
    assert with_latent_channels(flux, 32) == {"latent_channels": 32, "latents_mean": None}

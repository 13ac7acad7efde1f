"""Every family's tiny pipeline (assets/tiny-*/, families.py): compiled vs eager at three sizes, the
Space serving it through gradio_client, and a clear refusal for pipelines that are not supported.

Each family is compiled once per session for sides 256..512 (small sizes keep the CPU compiles
short) and its packages saved; the Space then starts from those packages (AOT_LOAD, strict), so
each family costs one compile and one quick app start.
"""

import json

import numpy as np
import pytest
import torch
from conftest import ROOT, TOLERANCE, Server
from gradio_client import Client, handle_file
from PIL import Image

from blocks import contract_from_captures, rel_error, repeated_blocks
from compile import load_pipeline, optimize_
from families import FAMILIES, family
from options import Options, Resolution


def pipeline_class(folder: str) -> str:
    return json.loads((ROOT / "assets" / folder / "model_index.json").read_text())["_class_name"]


TINY = sorted(p.parent.name for p in (ROOT / "assets").glob("tiny-*/model_index.json"))
# Supported families; tiny-flux (FLUX.1-dev) has its own tests (test_compile.py, test_app.py).
FOLDERS = [
    pytest.param(f, marks=pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}"))
    for f in TINY
    if pipeline_class(f) in FAMILIES and f != "tiny-flux"
    for missing in [FAMILIES[pipeline_class(f)].missing()]
]
NEEDING = [f for f in TINY if pipeline_class(f) in FAMILIES and FAMILIES[pipeline_class(f)].missing()]
UNSUPPORTED_FOLDERS = [f for f in TINY if pipeline_class(f) not in FAMILIES]
SIDES = {"min_side": 256, "max_side": 512}
SIZES = [(256, 256), (512, 512), (256, 512)]


def options(folder: str, **changes) -> Options:
    return Options(model=str(ROOT / "assets" / folder), device="cpu", **SIDES, **changes)


def input_image() -> Image.Image:
    """An input image for the edit families, of another size than any output (the app resizes it)."""
    pixels = np.indices((200, 300)).sum(axis=0) % 256
    return Image.fromarray(np.stack([pixels, 255 - pixels, pixels // 2], axis=-1).astype(np.uint8))


def images(pipe, height: int, width: int, steps: int = 2, prompt: str = "a red cat on a mat") -> torch.Tensor:
    row = family(type(pipe).__name__)
    image = input_image() if row.image_input == "required" else None
    call = row.call(pipe, prompt, height, width, steps, row.defaults(pipe)[1], image)
    return pipe(**call, generator=torch.Generator().manual_seed(0), output_type="pt").images


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """folder -> (compiled pipeline, packages folder): each family compiled once, on first use."""
    cache = {}

    def get(folder: str):
        if folder not in cache:
            packages = tmp_path_factory.mktemp(folder) / "packages"
            pipe = load_pipeline(options(folder))
            optimize_(pipe, options(folder, save=str(packages)))
            cache[folder] = pipe, packages
        return cache[folder]

    return get


@pytest.mark.parametrize("folder", FOLDERS)
def test_compiled_family_matches_eager_at_both_ends_and_non_square(folder, saved):
    compiled, _ = saved(folder)
    eager = load_pipeline(options(folder))
    for height, width in SIZES:
        expected = images(eager, height, width)
        actual = images(compiled, height, width)
        assert actual.shape == (1, 3, height, width)
        error = rel_error(actual, expected)
        assert error < TOLERANCE, f"{folder} {height}x{width}: rel. error {error:.2e}"
    if family(pipeline_class(folder)).text_rule == "prompt":  # a text length other than the captured ones
        prompt = "a long prompt about a red cat on a mat by the window " * 5
        error = rel_error(images(compiled, 256, 512, prompt=prompt), images(eager, 256, 512, prompt=prompt))
        assert error < TOLERANCE, f"{folder}, long prompt: rel. error {error:.2e}"


@pytest.mark.parametrize("folder", FOLDERS)
def test_space_serves_the_family_from_its_saved_packages(folder, saved, tmp_path):
    _, packages = saved(folder)
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
            with pytest.raises(Exception, match="Upload an input image"):
                client.predict(*args, api_name="/generate")
            args += ["none", handle_file(str(image_path))]  # no LoRA, the input image
        path, seed, notes = client.predict(*args, api_name="/generate")  # text-only clients omit the image
        assert np.asarray(Image.open(path)).shape == (256, 384, 3) and seed == 5
        assert "AoT loaded from" in app.text(), "the Space compiled instead of loading the saved packages"
    finally:
        app.stop()


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


@pytest.mark.parametrize("folder", UNSUPPORTED_FOLDERS)
def test_tiny_pipeline_of_a_family_not_built_yet_is_refused_before_its_weights_load(folder):
    with pytest.raises(ValueError, match=rf"{pipeline_class(folder)} is not supported: .*Supported pipelines"):
        load_pipeline(Options(model=str(ROOT / "assets" / folder), device="cpu"))


@pytest.mark.parametrize("folder", NEEDING)
def test_family_whose_pipeline_needs_a_missing_module_says_which_at_startup(folder):
    missing = FAMILIES[pipeline_class(folder)].missing()
    with pytest.raises(RuntimeError, match=rf"needs {missing[0]}, which is not installed: pip install"):
        load_pipeline(Options(model=str(ROOT / "assets" / folder), device="cpu"))


def test_blocks_of_one_class_with_two_weight_layouts_get_a_package_each():
    # Z-Image's refiner blocks are ZImageTransformerBlocks without modulation weights.
    from diffusers import ZImageTransformer2DModel

    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=16,
        axes_dims=[4, 6, 6],
        axes_lens=[64, 64, 64],
    )
    groups = repeated_blocks(transformer)
    assert sorted(groups) == ["ZImageTransformerBlock-1", "ZImageTransformerBlock-2"]
    layouts = {name: {block.modulation for block in blocks} for name, blocks in groups.items()}
    assert sorted(map(sorted, layouts.values())) == [[False], [True]], layouts
    # 2 main + 1 noise-refiner blocks are modulated, the 1 context-refiner block is not
    assert sorted(len(blocks) for blocks in groups.values()) == [1, 3]


def test_text_length_that_follows_the_prompt_is_a_checked_dynamic_dimension():
    # Qwen-Image's block inputs: image and text tokens in separate tensors, the rotary tables too.
    def inputs(image, text):
        return {"x": torch.zeros(1, image, 8), "text": torch.zeros(1, text, 8), "text_rope": torch.zeros(text, 4)}

    resolution = Resolution(256, 512)
    calls = [((), inputs(256, 14)), ((), inputs(1024, 14))]
    contract = contract_from_captures("Block", calls, [256, 1024], resolution, ((), inputs(256, 83)), (2, 512))
    assert [(s.path, s.shape, s.texts) for s in contract.tensors] == [
        ("x", (1, None, 8), (False, False, False)),
        ("text", (1, None, 8), (False, True, False)),
        ("text_rope", (None, 4), (True, False)),
    ]
    contract.check(inputs(512, 300))
    with pytest.raises(ValueError, match=r"compiled for 2\.\.512 text tokens; text has 600"):
        contract.check(inputs(512, 600))
    with pytest.raises(ValueError, match="text_rope has 20"):
        contract.check({**inputs(512, 300), "text_rope": torch.zeros(20, 4)})
    # FLUX's rotary table covers text + image tokens: with a text length that varies it follows both.
    joint = [((), {"rope": torch.zeros(n + t, 4)}) for n, t in ((256, 14), (1024, 14), (256, 83))]
    with pytest.raises(ValueError, match="follows both the image size and the prompt"):
        contract_from_captures("Block", joint[:2], [256, 1024], resolution, joint[2], (2, 512))

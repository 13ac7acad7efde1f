"""The shipped tiny pipelines under assets/: each folder is what its seeded script builds, and each runs.

One row per folder: the script that writes it, the pipeline class it must load as, the call arguments
beyond the prompt, and the shape of the latents a 256x256 call returns (`output_type="latent"`).
"""

import sys
from pathlib import Path

import PIL.Image
import pytest
import torch
from diffusers import DiffusionPipeline

ASSETS = Path(__file__).resolve().parent.parent / "assets"
sys.path.insert(0, str(ASSETS))  # the scripts import each other as siblings, as when run from the command line

EDIT_IMAGE = PIL.Image.new("RGB", (256, 256), (120, 40, 200))
# folder: (script module, pipeline class, call arguments, latent shape at 256x256)
TINY = {
    "tiny-flux": ("make_tiny_flux", "FluxPipeline", {}, (1, 256, 16)),
    "tiny-flux-schnell": ("make_tiny_flux_schnell", "FluxPipeline", {}, (1, 256, 16)),
    "tiny-flux-kontext": (
        "make_tiny_flux_kontext",
        "FluxKontextPipeline",
        {"image": EDIT_IMAGE, "max_area": 256 * 256, "_auto_resize": False},
        (1, 256, 16),
    ),
    "tiny-chroma": ("make_tiny_chroma", "ChromaPipeline", {"max_sequence_length": 32}, (1, 256, 16)),
    "tiny-z-image": ("make_tiny_z_image", "ZImagePipeline", {"max_sequence_length": 64}, (1, 4, 32, 32)),
    "tiny-qwen-image": ("make_tiny_qwen_image", "QwenImagePipeline", {"max_sequence_length": 64}, (1, 256, 16)),
    "tiny-qwen-image-edit": ("make_tiny_qwen_image_edit", "QwenImageEditPipeline", {"image": EDIT_IMAGE}, (1, 256, 16)),
    "tiny-flux2-klein": ("make_tiny_flux2_klein", "Flux2KleinPipeline", {"max_sequence_length": 64}, (1, 4, 32, 32)),
    "tiny-flux2": ("make_tiny_flux2", "Flux2Pipeline", {"max_sequence_length": 64}, (1, 256, 16)),
}
# transformers' Qwen2VLProcessor (its video processor) and PixtralProcessor cannot be built or loaded without
# torchvision.
NEEDS = {"tiny-qwen-image-edit": "torchvision", "tiny-flux2": "torchvision"}
SHIPPED = [name for name in TINY if (ASSETS / name / "model_index.json").is_file()]


@pytest.fixture(scope="module", params=SHIPPED)
def shipped(request):
    name = request.param
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason=f"{name} needs {NEEDS[name]}")
    script, pipeline_class, call, shape = TINY[name]
    pipe = DiffusionPipeline.from_pretrained(ASSETS / name)
    return name, __import__(script), pipeline_class, pipe, call, shape


def _modules(pipe) -> dict[str, torch.nn.Module]:
    return {name: part for name, part in pipe.components.items() if isinstance(part, torch.nn.Module)}


def test_folder_is_what_its_script_builds(shipped):
    name, script, pipeline_class, saved, _, _ = shipped
    assert type(saved).__name__ == pipeline_class, f"{name} loads as {type(saved).__name__}"
    built = script.build()
    assert sorted(_modules(built)) == sorted(_modules(saved)), name
    for part, module in _modules(built).items():
        want, got = module.state_dict(), _modules(saved)[part].state_dict()
        assert sorted(want) == sorted(got), f"{name}/{part}: different parameter names"
        for key, tensor in want.items():
            diff = (tensor.float() - got[key].float()).abs()
            assert tensor.shape == got[key].shape and diff.max() == 0, (
                f"{name}/{part}.{key}: max diff {diff.max():.3g}, mean {diff.mean():.3g} (rerun {script.__name__}.py)"
            )
    want, got = ({k: v for k, v in pipe.scheduler.config.items() if not k.startswith("_")} for pipe in (built, saved))
    assert want == got, f"{name}: scheduler config differs"
    for part, text in _texts(built).items():
        assert text == _texts(saved)[part], f"{name}/{part}: saved tokenizer or processor differs from the built one"


def _texts(pipe) -> dict:
    """What defines each tokenizer and processor: vocabulary, chat template, image processor settings."""
    texts = {}
    for name, part in pipe.components.items():
        tokenizer = getattr(part, "tokenizer", part)
        if hasattr(tokenizer, "get_vocab"):
            texts[name] = (tokenizer.get_vocab(), getattr(tokenizer, "chat_template", None))
        if hasattr(part, "image_processor"):
            texts[name] += (part.image_processor.to_dict(),)
    return texts


def test_two_steps_give_finite_latents(shipped):
    name, _, _, pipe, call, shape = shipped
    latents = pipe(
        prompt="a cat on a mat",
        height=256,
        width=256,
        num_inference_steps=2,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        **call,
    ).images
    assert tuple(latents.shape) == shape, f"{name}: latents {tuple(latents.shape)}, expected {shape}"
    assert torch.isfinite(latents).all(), f"{name}: non-finite latents"


def test_repeated_blocks_have_two_of_each_class(shipped):
    name, _, _, pipe, _, _ = shipped
    transformer = pipe.transformer
    for block_class in transformer._repeated_blocks:
        count = sum(type(module).__name__ == block_class for module in transformer.modules())
        assert count >= 2, f"{name}: {count} {block_class} (one package should serve several blocks)"

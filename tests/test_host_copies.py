"""No family's transformer step copies from host memory once its first step has run: a CUDA graph
capture refuses such a copy (`graphs.py`), so a family whose step makes one runs without graphs.

A CPU machine has no CUDA graph to capture, so the step runs on torch's `meta` device: every tensor
there has a shape and no data, and a host tensor reaching it goes through the same `aten._to_copy`
a copy to the GPU goes through. A dispatch mode records each such copy. The first step is run
before it is watched: what a step caches on the device (Qwen-Image's and Z-Image's rotary tables)
is made once, before any capture, as on the GPU.
"""

import pytest
import torch
from conftest import ROOT
from test_families import TINY, images, pipeline_class
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from aot.export import capture
from aot.families import FAMILIES, family, graph_safe_
from aot.options import Options
from aot.pipeline import load_pipeline

FOLDERS = [
    pytest.param(f, marks=pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}"))
    for f in TINY
    if pipeline_class(f) in FAMILIES
    for missing in [FAMILIES[pipeline_class(f)].missing()]
]


class HostCopies(TorchDispatchMode):
    """Records every op that copies a CPU tensor to another device, by op name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            sources = [t.device.type for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            targets = [t.device.type for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            if "cpu" in sources and any(device != "cpu" for device in targets):
                self.ops.append(str(func))
        return out


def step_on_meta(folder: str, fix: bool) -> list[str]:
    """The host copies of the second step of `folder`'s transformer on the meta device (its inputs
    are one real step's at 256x256), after `families.graph_safe_` if `fix`."""
    pipe = load_pipeline(Options(model=str(ROOT / "assets" / folder), device="cpu", compile=False))
    row = family(type(pipe).__name__)
    with capture({"transformer": pipe.transformer}) as calls:
        pipe(**row.capture_call(pipe, "a red cat on a mat", 256, 256), output_type="latent")
    transformer = pipe.transformer.to("meta")
    if fix:
        graph_safe_(transformer)
    kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), calls["transformer"][1])
    copies = HostCopies()
    with torch.no_grad():
        transformer(**kwargs)
        with copies:
            transformer(**kwargs)
    return copies.ops


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_family_step_copies_from_the_host_once_made_capturable(folder):
    assert step_on_meta(folder, fix=True) == []


def test_chroma_step_copies_from_the_host_unless_made_capturable():
    """What `graph_safe_` removes is there without it (diffusers 0.42.1's Chroma time embedding)."""
    assert step_on_meta("tiny-chroma", fix=False) == ["aten._to_copy.default"]


def test_made_capturable_chroma_computes_the_same_images():
    pipe = load_pipeline(Options(model=str(ROOT / "assets" / "tiny-chroma"), device="cpu", compile=False))
    before = images(pipe, 256, 256)
    assert graph_safe_(pipe.transformer) == ["time_text_embed.guidance_proj"]
    assert graph_safe_(pipe.transformer) == ["time_text_embed.guidance_proj"]  # once: not wrapped twice
    assert type(pipe.transformer.time_text_embed.guidance_proj.proj).__name__ == "Timesteps"
    assert torch.equal(images(pipe, 256, 256), before)

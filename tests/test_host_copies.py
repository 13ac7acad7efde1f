"""No family's transformer step copies from host memory once its first step has run: a CUDA graph
capture refuses such a copy (`graphs.py`), so a family whose step makes one runs without graphs.

A CPU machine has no CUDA graph to capture, so the step runs on torch's `meta` device: every tensor
there has a shape and no data, and a host tensor reaching it goes through the same `aten._to_copy`
a copy to the GPU goes through. A dispatch mode records each such copy. The first step is run
before it is watched: what a step caches on the device (Qwen-Image's and Z-Image's rotary tables)
is made once, before any capture, as on the GPU.
"""

import copy
import functools
from typing import Any

import pytest
import torch
from conftest import ROOT
from test_families import TINY, images, pipeline_class
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from aot.families import FAMILIES, graph_safe_
from aot.options import Options
from aot.pipeline import load_pipeline
from tools.bench import step_inputs

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


@functools.cache
def first_step(folder: str) -> tuple[Any, dict[str, Any]]:
    """`folder`'s tiny pipeline (eager, CPU) and its transformer's inputs at its first step at
    256x256, as tools/bench.py measures a step (`step_inputs`); shared with tests/test_bench.py."""
    pipe = load_pipeline(Options(model=str(ROOT / "assets" / folder), device="cpu", compile=False))
    return pipe, step_inputs(pipe, 256)


def step_on_meta(folder: str, fix: bool) -> list[str]:
    """The host copies of the second step of a copy of `folder`'s transformer on the meta device
    (`first_step`'s inputs), after `families.graph_safe_` if `fix`."""
    pipe, inputs = first_step(folder)
    transformer = copy.deepcopy(pipe.transformer).to("meta")
    if fix:
        graph_safe_(transformer)
    kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), inputs)
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

"""tools/bench.py measures a step on inputs a Space serves: each family's first step is finite.

A CUDA graph's check replay compares the replay with the step it was captured from, so a step that
gives NaN fails it (NaN is never equal to itself) and the benchmark reports graphs that cannot run.
"""

import pytest
import torch
from conftest import ROOT
from test_host_copies import FOLDERS
from torch.utils import _pytree as pytree

from aot.export import capture
from aot.options import Options
from aot.pipeline import load_pipeline
from tools.bench import pipe_call, step_inputs


def tiny(folder: str):
    return load_pipeline(Options(model=str(ROOT / "assets" / folder), device="cpu", compile=False))


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_benchmarks_step_inputs_give_every_family_a_finite_step(folder):
    pipe = tiny(folder)
    with torch.no_grad():
        out = pipe.transformer(**step_inputs(pipe, 256))
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    assert leaves and all(torch.isfinite(t).all() for t in leaves)


def test_a_qwen_image_call_of_one_step_gives_a_nan_timestep():
    """Why `step_inputs` calls with the family's `min_steps` (2 for Qwen-Image), not 1."""
    pipe = tiny("tiny-qwen-image")
    with capture({"transformer": pipe.transformer}) as calls:
        pipe(**pipe_call(pipe, 256, 1), output_type="latent")
    assert torch.isnan(calls["transformer"][1]["timestep"]).all()

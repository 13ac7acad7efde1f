"""Shared fixtures: the bundled tiny FLUX pipeline, compiled once per test session (about 20 s on 2 cores)."""

from pathlib import Path

import pytest
import torch

from blocks import apply_
from compile import compile_blocks, load_pipeline
from options import Options

TINY = str(Path(__file__).resolve().parents[1] / "assets" / "tiny-flux")
# float32 on CPU: compiled blocks match eager ones to ~1e-7 relative (measured 4e-7 on the final
# images); 1e-5 leaves room for other CPUs' vector widths, and still fails for any real mistake.
TOLERANCE = 1e-5


def tiny_options(**changes) -> Options:
    return Options(model=TINY, device="cpu", **changes)


def load_tiny():
    return load_pipeline(tiny_options())


def generate(pipe, height: int, width: int, seed: int = 0, steps: int = 2, **kwargs) -> torch.Tensor:
    """Images as a float tensor [batch, 3, height, width] in [0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    return pipe(
        "a red cat on a mat",
        height=height,
        width=width,
        num_inference_steps=steps,
        generator=generator,
        output_type="pt",
        **kwargs,
    ).images


@pytest.fixture(scope="session")
def compiled():
    """`compile_blocks` on the tiny pipeline: one package per block class."""
    return compile_blocks(load_tiny(), tiny_options())


@pytest.fixture
def eager_pipe():
    return load_tiny()


@pytest.fixture
def compiled_pipe(compiled):
    """A freshly loaded tiny pipeline with the session's packages applied."""
    pipe = load_tiny()
    apply_(pipe, compiled)
    return pipe

"""The tanh GELU as every package computes it: `gelu_tanh_approx`, which `lowering.DECOMPOSITIONS` writes
in place of `aten.gelu(x, approximate="tanh")`, its tanh an op of its own (`tanh_approx`, which
`lowering._lower_tanh_approx` teaches Inductor as one PTX instruction), and its constants, which
row_fp8.py's kernel and rewrite read too."""

from __future__ import annotations

import math

import torch

# sqrt(2 / pi): the constant of GELU's tanh approximation (torch.nn.GELU's docs).
SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
# The cube's factor in the same approximation: z = sqrt(2 / pi) (x + 0.044715 x^3).
GELU_CUBE = 0.044715
# PTX's tanh.approx.f32, sm_75 and later: at most 2^-11 relative error over the whole float range,
# subnormal inputs passed through (PTX ISA 9.1, "Floating Point Instructions: tanh"); measured at most
# 1.1e-5 (NVIDIA's developer forums, "Hardware-accelerated tanh() on Turing").
TANH_APPROX_PTX = "tanh.approx.f32 $0, $1;"


@torch.library.custom_op("aot_lowering::tanh_approx", mutates_args=())
def tanh_approx(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) where the package may compute it to 2^-11 of itself: any shape; out the same shape and
    `torch.tanh`'s dtype (a float dtype stays, integers become the default float). Eager it is
    `torch.tanh`. In a package compiled for an NVIDIA GPU (`lowering.compile_package`), Inductor computes it
    in float32 with one `TANH_APPROX_PTX` instruction inside whichever kernel it fuses into; float64,
    integers and other devices get Inductor's own tanh (`lowering._lower_tanh_approx`)."""
    return torch.tanh(x)


@tanh_approx.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)  # on fake tensors: torch's own shape and dtype rule, no data


def gelu_tanh_approx(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """`aten.gelu(x, approximate="tanh")`, 0.5 x (1 + tanh(z)) with z = sqrt(2/pi) (x + 0.044715 x^3),
    torch's own formula, with its tanh a `tanh_approx`. Any shape; computed in float32 (float64
    stays float64) and returned in x's dtype.

    FLUX's blocks compute this GELU in the kernels that also quantize the next GEMM's input rows to
    FP8, and its tanh sets their pace: in FLUX.1-dev's step on an H100 the single block's `proj_out`
    input kernel took 102 us a call against 130 us with the GELU as x sigmoid(2z) (one `exp2`, one
    division) and 175 us with libdevice's tanhf; the step 86.4 against 87.4 ms (BENCHMARKS.md, "GELU
    with the GPU's tanh"). Where 1 + tanh(z) is small the instruction's error grows against the GELU:
    at x = -3 by 412 times, so 2^-11 of tanh would be 20% of the GELU and the measured 1.1e-5 is 0.5%,
    about a bf16 rounding; the FP8 cast after it rounds by up to 6%.

    Returns NotImplemented for the exact (erf) GELU, which a decomposition table then leaves as it is.
    """
    if approximate != "tanh":
        return NotImplemented
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (0.5 * xf * (1 + tanh_approx(SQRT_2_OVER_PI * (xf + GELU_CUBE * xf * xf * xf)))).to(x.dtype)

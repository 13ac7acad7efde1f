"""Each row of an FP8 GEMM's input made in one Triton kernel of ours: its parts joined along the features
(a `cat`), each part's last steps (the scales and bias `fp8.RowScalesAfterGEMM` applies after the GEMM that
made it, a tanh GELU), the row's abs-max and the FP8 cast. `row_fp8_sites.fuse_row_fp8` writes it into an
exported graph in place of torchao's quantization of such rows (`lowering.decomposed` runs it where
`row_fp8=on` asks).

Inductor fuses all of that into one kernel too, a persistent reduction with one row a program. Where the
row is a `cat`, each part is computed under the `cat`'s mask, and Inductor broadcasts every load inside
the mask to the mask's shape: at `row-after`, FLUX.1-dev's single block loads the MLP's row scale once
for each of the row's 15,360 entries, and the kernel took 211 us a call where its bytes take 63 us at the
H100's 3.35 TB/s (BENCHMARKS.md, "Row-wise FP8 where cuBLAS has none"); at `row`, 102 us. This kernel
reads each row in chunks, twice: the abs-max, then the cast, the second read from the L2 cache, with the
row scale loaded once a row.

The op, `aot_fp8::row_quantize`, for parts x_i (..., k_i) bf16, their leading dims alike: each part's value
v_i, then `torchao.choose_scale_float8` and `_quantize_affine_float8` of `cat([v_1, v_2], -1)`, row-wise,
as torchao's `Float8Tensor` quantizes an activation: each row's scale, its abs-max / 448 (float32, from
bf16), and its entries divided by that scale (at float32's smallest normal where `floor`, as
`RowScalesAfterGEMM` divides), saturated at +-448 and cast to float8_e4m3fn. On a CPU the op is its torch
reference (`reference`), which Inductor compiles as any other ops; `TRITON_INTERPRET=1` runs the kernel
there.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.library import triton_op, wrap_triton

from aot.gelu import GELU_CUBE, SQRT_2_OVER_PI, TANH_APPROX_PTX, gelu_tanh_approx

# float8_e4m3fn's largest finite value: torchao's scale is a row's abs-max over it, and the cast saturates there.
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
# float32's smallest normal: `RowScalesAfterGEMM` divides by the scale clamped here (an all-zero row).
FLOOR = torch.finfo(torch.float32).tiny
# The floor and the tanh GELU's constants (gelu.py) as the kernel reads them.
_FLOOR, _CUBE, _SQRT_2_OVER_PI = tl.constexpr(FLOOR), tl.constexpr(GELU_CUBE), tl.constexpr(SQRT_2_OVER_PI)
_TANH_PTX = tl.constexpr(TANH_APPROX_PTX)
# Entries of a row a program reads at a time, and its warps: 8 bf16 entries (16 bytes) a thread.
CONFIG = triton.Config({"BLOCK": 1024}, num_warps=4)
# The one dtype the parts come in: the GEMM outputs and attention outputs of bf16 blocks.
IN_DTYPE = torch.bfloat16
# Triton's interpreter (TRITON_INTERPRET=1, a CPU) runs the kernel itself, with `CONFIG` as its arguments.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tanh(z, GPU: tl.constexpr):
    """tanh(z) in float32: PTX's `tanh.approx.f32` (`gelu.TANH_APPROX_PTX`, what the GELU Inductor
    compiles uses), or (not on a GPU: Triton's interpreter, which runs no PTX) 1 - 2 / (exp(2z) + 1)."""
    if GPU:
        return tl.inline_asm_elementwise(_TANH_PTX, "=r,r", [z], dtype=tl.float32, is_pure=True, pack=1)
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def _bf16(v, GPU: tl.constexpr):
    """float32 v rounded to bf16 (to nearest, ties to even), as float32: the GPU's conversion, or (not on
    a GPU: Triton's interpreter, whose conversion truncates) the same rounding on v's bits."""
    if GPU:
        return v.to(tl.bfloat16).to(tl.float32)
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(v == v, bits.to(tl.float32, bitcast=True), v)


@triton.jit
def _part(
    X,
    R,
    C,
    B,
    row,
    stride,
    cols,
    ok,
    SCALED: tl.constexpr,
    BIAS: tl.constexpr,
    GELU: tl.constexpr,
    GPU: tl.constexpr,
):
    """A part's values at `cols` of row `row`, float32 holding bf16 values: x (SCALED: x r c + b in float32,
    rounded to bf16), then (GELU) 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), rounded to bf16, each
    product in the order the graph computes it."""
    v = tl.load(X + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
    if SCALED:
        scales = tl.load(R + row).to(tl.float32) * tl.load(C + cols, mask=ok, other=0.0).to(tl.float32)
        v = v * scales
        if BIAS:
            v = v + tl.load(B + cols, mask=ok, other=0.0).to(tl.float32)
        v = _bf16(v, GPU)
    if GELU:
        z = (v + v * _CUBE * v * v) * _SQRT_2_OVER_PI
        v = _bf16(v * 0.5 * (_tanh(z, GPU) + 1.0), GPU)
    return tl.where(ok, v, 0.0)  # past the row: 0, not what the scales made of the zeros loaded there (inf x 0)


@triton.jit
def _row_fp8_kernel(
    X1,
    X2,
    R1,
    R2,
    C1,
    C2,
    B1,
    B2,
    Out,
    Scale,
    width1,
    width2,
    stride1,
    stride2,
    SCALED1: tl.constexpr,
    BIAS1: tl.constexpr,
    GELU1: tl.constexpr,
    SCALED2: tl.constexpr,
    BIAS2: tl.constexpr,
    GELU2: tl.constexpr,
    TWO: tl.constexpr,
    FLOORED: tl.constexpr,
    GPU: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row a program, of one part (X1, its row scale R1, column scales C1, bias B1, `width1` entries) or
    (TWO) two joined (then X2's from entry `width1` on): each part's values (`_part`), the row's abs-max
    over them, its scale abs-max / 448 rounded to bf16 (as torchao divides a bf16 abs-max) into `Scale`,
    then each value divided by that scale (FLOORED: at least float32's smallest normal), saturated at +-448
    (NaN stays NaN), in float8_e4m3fn into `Out` (contiguous rows of width1 + width2). The row is read
    BLOCK entries at a time, twice: for its abs-max, then for the cast. GPU: PTX's tanh and the GPU's own
    roundings (else Triton's interpreter runs it: `_tanh`, `_bf16`)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    largest = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width1, BLOCK):
        ok = start + cols < width1
        v = _part(X1, R1, C1, B1, row, stride1, start + cols, ok, SCALED1, BIAS1, GELU1, GPU)
        largest = tl.maximum(largest, tl.abs(v), propagate_nan=tl.PropagateNan.ALL)
    if TWO:
        for start in range(0, width2, BLOCK):
            ok = start + cols < width2
            v = _part(X2, R2, C2, B2, row, stride2, start + cols, ok, SCALED2, BIAS2, GELU2, GPU)
            largest = tl.maximum(largest, tl.abs(v), propagate_nan=tl.PropagateNan.ALL)
    amax = tl.reduce(largest, 0, _nan_max)
    scale = _bf16(amax / 448.0, GPU)
    tl.store(Scale + row, scale)
    if FLOORED:
        scale = tl.maximum(scale, _FLOOR)
    width = width1 + width2 if TWO else width1
    for start in range(0, width1, BLOCK):
        ok = start + cols < width1
        v = _part(X1, R1, C1, B1, row, stride1, start + cols, ok, SCALED1, BIAS1, GELU1, GPU)
        _store(Out + row * width + start + cols, v / scale, ok)
    if TWO:
        for start in range(0, width2, BLOCK):
            ok = start + cols < width2
            v = _part(X2, R2, C2, B2, row, stride2, start + cols, ok, SCALED2, BIAS2, GELU2, GPU)
            _store(Out + row * width + width1 + start + cols, v / scale, ok)


@triton.jit
def _nan_max(a, b):
    """The larger of a and b, NaN where either is (as torch's amax, which torchao's scale takes)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _store(at, q, ok):
    """q saturated at +-448 (NaN stays NaN, as torch's clamp keeps it), stored as float8_e4m3fn."""
    q = tl.minimum(tl.maximum(q, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(at, q.to(tl.float8e4nv), mask=ok)


_configured = triton.autotune([CONFIG], key=["TWO"])(_row_fp8_kernel)


def part_value(
    x: torch.Tensor,
    row_scale: torch.Tensor | None,
    col_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    gelu: bool,
) -> torch.Tensor:
    """One part's values as the graph computes them, in torch ops: x, or (`row_scale` and `col_scale`
    given) `(x * (row_scale * col_scale) + bias).to(x.dtype)` in float32, as `fp8.RowScalesAfterGEMM`
    writes it; then (`gelu`) `gelu.gelu_tanh_approx`, the tanh GELU the graph was decomposed with (its
    `tanh_approx` is `torch.tanh` outside a GPU package), rounded to x's dtype."""
    v = x
    if row_scale is not None:
        v = x * (row_scale * col_scale)
        if bias is not None:
            v = v + bias
        v = v.to(x.dtype)
    return gelu_tanh_approx(v, "tanh") if gelu else v


def reference(
    xs: list[torch.Tensor],
    row_scales: list[torch.Tensor | None],
    col_scales: list[torch.Tensor | None],
    biases: list[torch.Tensor | None],
    gelu: list[bool],
    floor: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in torch's and torchao's ops: each part's values (`part_value`), joined,
    then torchao's row-wise scale and FP8 cast (`_choose_scale_float8`, `_quantize_affine_float8`), the
    scale clamped at `FLOOR` before the division where `floor`. Returns (data, scale)."""
    from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8  # heavy

    parts = zip(xs, row_scales, col_scales, biases, gelu, strict=True)
    joined = torch.cat([part_value(*part) for part in parts], -1)
    block = [1] * (joined.dim() - 1) + [joined.shape[-1]]
    scale = _choose_scale_float8(joined, block, torch.float8_e4m3fn)
    data = _quantize_affine_float8(joined, scale.clamp(min=FLOOR) if floor else scale, torch.float8_e4m3fn)
    return data, scale


def problem(
    xs: list[Any], row_scales: list[Any], col_scales: list[Any], biases: list[Any], gelu: list[bool]
) -> str | None:
    """Why the kernel cannot take these parts (real or fake tensors), or None: one or two parts x_i
    (..., k_i) bf16, leading dims alike and flattening to rows of one stride, entries contiguous; each
    part's row scale (..., 1) float32 and column scale (k_i,) bf16 both given or neither, a bias (k_i,) bf16
    only with them; one GELU flag a part."""
    if not 1 <= len(xs) <= 2 or not len(xs) == len(row_scales) == len(col_scales) == len(biases) == len(gelu):
        counts = [len(t) for t in (xs, row_scales, col_scales, biases, gelu)]
        return f"one or two parts, each with a row scale, a column scale, a bias and a GELU flag, not {counts}"
    lead = tuple(xs[0].shape[:-1])
    for x, row_scale, col_scale, bias in zip(xs, row_scales, col_scales, biases, strict=True):
        if x.dtype != IN_DTYPE or x.dim() < 2 or x.stride(-1) != 1:
            return f"each part must be (..., k) {IN_DTYPE}, its entries contiguous, not {tuple(x.shape)} {x.dtype}"
        alike = len(x.shape) == len(lead) + 1 and all(
            statically_known_true(a == b) for a, b in zip(x.shape, lead, strict=False)
        )
        if not alike:
            return f"the parts' leading dims must be alike, not {lead} and {tuple(x.shape[:-1])}"
        if statically_known_true(x.shape[-1] < 1):
            return f"each part must have an entry a row, not {tuple(x.shape)}"
        if _row_stride(x) is None:
            return f"a part's rows must be one stride apart, not {tuple(x.stride())} for {tuple(x.shape)}"
        if (row_scale is None) != (col_scale is None) or (bias is not None and row_scale is None):
            return "a part's row and column scales come together, and a bias only with them"
        if row_scale is None:
            continue
        if tuple(row_scale.shape) != (*lead, 1) or row_scale.dtype != torch.float32 or not row_scale.is_contiguous():
            return (
                f"a row scale must be {(*lead, 1)} float32, contiguous, not {tuple(row_scale.shape)} {row_scale.dtype}"
            )
        for vector in (v for v in (col_scale, bias) if v is not None):
            shaped = vector.dim() == 1 and statically_known_true(vector.shape[0] == x.shape[-1])
            if not shaped or vector.dtype != IN_DTYPE or vector.stride(-1) != 1:
                shown = f"{tuple(vector.shape)} {vector.dtype}"
                return f"column scales and biases must be ({x.shape[-1]},) {IN_DTYPE}, contiguous, not {shown}"
    width = sum(x.shape[-1] for x in xs)
    if not statically_known_true(width % 16 == 0):
        return f"the joined row must be a multiple of 16 entries wide, as an FP8 GEMM reads it, not {width}"
    return None


def _row_stride(x: Any) -> Any:
    """The stride between x's rows, its leading dims flattened (dims of one entry aside), or None where
    they do not flatten to rows one stride apart."""
    dims = [
        (n, stride)
        for n, stride in zip(x.shape[:-1], x.stride()[:-1], strict=True)
        if not statically_known_true(n == 1)
    ]
    for (_, outer), (n, inner) in zip(dims, dims[1:], strict=False):
        if not statically_known_true(outer == inner * n):
            return None
    return dims[-1][1] if dims else x.shape[-1]


@triton_op("aot_fp8::row_quantize", mutates_args=())
def row_quantize(
    x: list[torch.Tensor],
    row_scale: list[torch.Tensor | None],
    col_scale: list[torch.Tensor | None],
    bias: list[torch.Tensor | None],
    gelu: list[bool],
    floor: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of the parts `x` (one or two, each (..., k_i) bf16 with the same leading dims, rows one
    stride apart, entries contiguous), each part's values first (`row_scale` (..., 1) float32 with
    `col_scale` (k_i,) bf16 and an optional `bias` (k_i,) bf16: x times both plus the bias in float32,
    rounded to bf16; `gelu`: then the tanh GELU, rounded to bf16), joined along the last dim, quantized to
    FP8 row-wise as torchao's `Float8Tensor` quantizes an activation. Returns (data, scale): data (...,
    sum of k_i) float8_e4m3fn, contiguous; scale (..., 1) float32, each row's abs-max / 448 (the row's
    entries divided by it, or by `FLOOR` where it is smaller and `floor`, as `RowScalesAfterGEMM` divides).

    Raises:
        ValueError: tensors the kernel cannot take (`problem` says which).
    """
    trouble = problem(x, row_scale, col_scale, bias, gelu)
    if trouble:
        raise ValueError(f"row_fp8: {trouble}")
    if x[0].device.type == "cpu" and not _INTERPRETED:
        return reference(x, row_scale, col_scale, bias, gelu, floor)
    lead = tuple(x[0].shape[:-1])
    width = sum(part.shape[-1] for part in x)
    data = torch.empty((*lead, width), dtype=torch.float8_e4m3fn, device=x[0].device)
    scale = torch.empty((*lead, 1), dtype=torch.float32, device=x[0].device)
    rows = data.numel() // width
    (x1, *rest) = x
    x2 = rest[0] if rest else x1
    parts = [(x1, row_scale[0], col_scale[0], bias[0], gelu[0])]
    parts.append((x2, row_scale[-1], col_scale[-1], bias[-1], gelu[-1]))
    flags, pointers = {}, []
    for i, (part, r, c, b, g) in enumerate(parts, 1):
        flags.update({f"SCALED{i}": r is not None, f"BIAS{i}": b is not None, f"GELU{i}": g})
        pointers.append((part, part if r is None else r, part if c is None else c, part if b is None else b))
    (p1, r1, c1, b1), (p2, r2, c2, b2) = pointers
    kernel, config = (_row_fp8_kernel, CONFIG.all_kwargs()) if _INTERPRETED else (wrap_triton(_configured), {})
    kernel[(rows,)](
        p1,
        p2,
        r1,
        r2,
        c1,
        c2,
        b1,
        b2,
        data,
        scale,
        x1.shape[-1],
        x2.shape[-1] if rest else 0,
        _row_stride(x1),
        _row_stride(x2),
        **flags,
        TWO=bool(rest),
        FLOORED=floor,
        GPU=not _INTERPRETED,
        **config,
    )
    return data, scale

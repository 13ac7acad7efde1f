"""Each head's RMS norm and RoPE in one Triton kernel of our own, which `norm_rope_sites.fuse_norm_rope`
writes into an exported graph in place of the ops diffusers computes them with (`lowering.decomposed` runs it
where the plan or `norm_rope=on` asks, before `rotations.flip_pair_rotations`).

Inductor fuses the norm and the rotation into one kernel too, but it has no operation that swaps two
values between a thread's registers: it reads each pair's other entry with a load of its own, two bytes
at a time, and FLUX.1-dev's single block's q and k kernel is bound by the L1 cache, 70.4 us a call on an
H100 where the same kernel by hand in Triton, each pair split and joined in registers (`tl.split`,
`tl.join`), took 38.3 us (1 x 4608 x 24 x 128, q and k; BENCHMARKS.md, "Pair rotations flipped"). This
module is that kernel, registered with `torch.library.triton_op` so that AOTInductor compiles it into the
block's package; on a CPU the op is its torch reference (`reference`), which Inductor compiles as any
other ops, and `TRITON_INTERPRET=1` runs the kernel there. In FLUX.1-dev's step on an H100 it took 1.80 ms
where Inductor's took 2.52, and the step 80.6 against 81.8 ms (BENCHMARKS.md, "Each head's norm and RoPE in a
kernel of ours").

The ops, for x (batch, seq, heads, head_dim) bf16, float16 or float32 with the head dim contiguous, in
one part or two (a double block's text and image heads, each with its own norm, joined along the sequence
into the one tensor attention reads, so that no `cat` copies them):
* `aot_rope::norm_rope_real`: diffusers' `apply_rotary_emb` (FLUX.1, FLUX.2, Chroma), cos and sin one
  float32 value an entry;
* `aot_rope::norm_rope_complex`: the complex product of Qwen-Image's and Z-Image's RoPE, the factors
  one complex value a pair, given as their `view_as_real`;
each the RMS norm over the head dim (in float32, rounded to x's dtype as torch's `RMSNorm` or diffusers'
rounds it), the rotation in float32, rounded to x's dtype, and then, where the graph casts the result to
FP8 for attention (`fa3.unit_scaled`), that cast too.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.library import triton_op, wrap_triton

aten = torch.ops.aten
# float8_e4m3fn's largest finite value: the cast to FP8 saturates there (`fa3.unit_scaled`).
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
# Head rows a program normalizes and rotates, and its warps: the best of twelve launches of the hand
# kernel at FLUX.1-dev's single block (H100, 37.2 us a call; BENCHMARKS.md, "Pair rotations flipped").
CONFIG = triton.Config({"ROWS": 4}, num_warps=2)
# Where each row of x and of the factors starts: a multiple of this many bytes (`problem`), so that the
# kernel loads them 16 bytes at a time.
ALIGN_BYTES = 16
# The dtypes the kernel reads x in and writes its output in.
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (*IN_DTYPES, torch.float8_e4m3fn)
# Triton's interpreter (TRITON_INTERPRET=1, a CPU) runs the kernel itself, with `CONFIG` as its arguments.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _norm_rope_kernel(
    X, X2, W, W2, C, C2, S, S2, Out,
    rows, seq, seq1, heads,
    stride_xb, stride_xs, stride_xh, stride_x2b, stride_x2s, stride_x2h,
    stride_cb, stride_cs, stride_ch, stride_c2b, stride_c2s, stride_c2h,
    stride_sb, stride_ss, stride_sh, stride_s2b, stride_s2s, stride_s2h,
    eps,
    HEAD_DIM: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND_FIRST: tl.constexpr, COMPLEX: tl.constexpr,
    SATURATE: tl.constexpr, ROWS: tl.constexpr, ALIGN_X: tl.constexpr, ALIGN_F: tl.constexpr, JOINED: tl.constexpr,
):
    """ROWS head rows a program of the joint sequence of one part or two (JOINED: X, W, C, S for its first
    `seq1` tokens, X2, W2, C2, S2 for the rest, each with its own strides; else X, W, C, S alone, and the
    second part's arguments unread, so that one part compiles to the code it had before parts): their RMS
    norm (ROUND_FIRST: rounded to x's dtype before the weight, as diffusers' `RMSNorm` computes it), then
    each pair (e, o) rotated by its factors (`C`, `S` one value an entry; COMPLEX: `C` holds (cos, sin) a
    pair, `S` unused), rounded to x's dtype, then to `Out`'s (SATURATE: clamped to +-448 first, as
    `fa3.unit_scaled` does), into the joint (batch, seq, heads, HEAD_DIM) `Out`. Each row of x starts a
    multiple of ALIGN_X entries in, each row of the factors of ALIGN_F (`problem` checks: 16 bytes), said to
    the compiler, which cannot see it in a stride that follows the token count, so that a row loads 16 bytes
    at a time: without it, x loads two bytes at a time (the PTX sm_90 gets, tests/test_norm_rope.py)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < rows
    h, s, b = r % heads, (r // heads) % seq, r // (heads * seq)
    entries = tl.arange(0, HEAD_DIM)
    d = entries[None, :]
    x_at = _at(
        X, X2, b, s, h, seq1, stride_xb, stride_xs, stride_xh, stride_x2b, stride_x2s, stride_x2h, ALIGN_X, JOINED
    )
    x = tl.load(x_at + d, mask=ok[:, None], other=0.0)
    xf = x.to(tl.float32)
    # AOTInductor passes a Python float as fp64: cast, or the norm would run in fp64.
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + tl.cast(eps, tl.float32))
    normed = xf * inv[:, None]
    if ROUND_FIRST:
        normed = normed.to(x.dtype).to(tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W + entries).to(tl.float32)[None, :]
        if JOINED:
            w = tl.where((s < seq1)[:, None], w, tl.load(W2 + entries).to(tl.float32)[None, :])
        normed = normed * w
    normed = normed.to(x.dtype).to(tl.float32)  # the norm's output, rounded as torch rounds it
    e, o = tl.split(tl.reshape(normed, (ROWS, HEAD_DIM // 2, 2)))
    c_at = _at(
        C, C2, b, s, h, seq1, stride_cb, stride_cs, stride_ch, stride_c2b, stride_c2s, stride_c2h, ALIGN_F, JOINED
    )
    c = tl.load(c_at + d, mask=ok[:, None], other=0.0)
    if COMPLEX:  # (e + i o)(c + i s)
        cos, sin = tl.split(tl.reshape(c.to(tl.float32), (ROWS, HEAD_DIM // 2, 2)))
        out = tl.join(e * cos - o * sin, o * cos + e * sin)
    else:  # x cos + stack(-o, e) sin, one factor an entry
        s_at = _at(
            S, S2, b, s, h, seq1, stride_sb, stride_ss, stride_sh, stride_s2b, stride_s2s, stride_s2h, ALIGN_F, JOINED
        )
        s_ = tl.load(s_at + d, mask=ok[:, None], other=0.0)
        cos_e, cos_o = tl.split(tl.reshape(c.to(tl.float32), (ROWS, HEAD_DIM // 2, 2)))
        sin_e, sin_o = tl.split(tl.reshape(s_.to(tl.float32), (ROWS, HEAD_DIM // 2, 2)))
        out = tl.join(e * cos_e - o * sin_e, o * cos_o + e * sin_o)
    out = tl.reshape(out, (ROWS, HEAD_DIM)).to(x.dtype)
    if SATURATE:  # NaN stays NaN, as torch's clamp keeps it
        out = tl.maximum(out.to(tl.float32), -448.0, propagate_nan=tl.PropagateNan.ALL)
        out = tl.minimum(out, 448.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(Out + r[:, None] * HEAD_DIM + d, out.to(Out.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _at(P, P2, b, s, h, seq1, stride_b, stride_s, stride_h, stride_b2, stride_s2, stride_h2, ALIGN: tl.constexpr,
        JOINED: tl.constexpr):
    """Where each row of a tensor read in parts starts, (ROWS, 1) pointers, each row's offset said to be a
    multiple of ALIGN entries: in P, or (JOINED) in P2 from token `seq1` on."""
    at = P + tl.multiple_of(b * stride_b + s * stride_s + h * stride_h, ALIGN)[:, None]
    if JOINED:
        second = P2 + tl.multiple_of(b * stride_b2 + (s - seq1) * stride_s2 + h * stride_h2, ALIGN)[:, None]
        at = tl.where((s < seq1)[:, None], at, second)
    return at


_configured = triton.autotune([CONFIG], key=["HEAD_DIM"])(_norm_rope_kernel)


def reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor | None,
    out_dtype: torch.dtype,
    round_first: bool,
) -> torch.Tensor:
    """What the kernel computes, in torch ops (`norm_rope_real` and `norm_rope_complex`; `sin` None:
    `cos` holds the complex form's (cos, sin) pairs)."""
    normed = torch.nn.functional.rms_norm(x, x.shape[-1:], None if round_first else weight, eps)
    if round_first and weight is not None:
        normed = normed * weight
    normed = normed.float().unflatten(-1, (-1, 2))
    e, o = normed.unbind(-1)
    if sin is None:
        cos, sin = cos.unflatten(-1, (-1, 2)).unbind(-1)
        pairs = (e * cos - o * sin, o * cos + e * sin)
    else:
        (cos_e, cos_o), (sin_e, sin_o) = (t.unflatten(-1, (-1, 2)).unbind(-1) for t in (cos, sin))
        pairs = (e * cos_e - o * sin_e, o * cos_o + e * sin_o)
    out = torch.stack(pairs, -1).flatten(-2).to(x.dtype)
    if out_dtype == torch.float8_e4m3fn:
        out = out.clamp(-E4M3_MAX, E4M3_MAX)
    return out.to(out_dtype)


def problem(
    xs: list[Any], weights: list[Any], factors: list[tuple[Any, ...]], out_dtype: torch.dtype
) -> str | None:
    """Why the kernel cannot take these parts of a joint sequence (real or fake tensors; `xs` one or two
    (batch, seq, heads, head_dim) tensors, `weights` and `factors` one each, a factor tuple (cos, sin) or
    (pairs,)), or None."""
    if not 1 <= len(xs) <= 2 or not len(xs) == len(weights) == len(factors):
        return f"one or two parts, each with a weight and factors, not {len(xs)}, {len(weights)}, {len(factors)}"
    if len({weight is None for weight in weights}) > 1:
        return "either every part's norm has a weight or none does"
    for x, weight, part_factors in zip(xs, weights, factors, strict=True):
        trouble = _part_problem(x, weight, part_factors, out_dtype)
        if trouble:
            return trouble
    first, *rest = xs
    for x in rest:
        same = all(statically_known_true(x.shape[i] == first.shape[i]) for i in (0, 2, 3))
        if not same or x.dtype != first.dtype:
            shapes = f"{tuple(first.shape)} {first.dtype} and {tuple(x.shape)} {x.dtype}"
            return f"the parts must share dtype, batch, heads and head dim, not {shapes}"
    return None


def _part_problem(x: Any, weight: Any, factors: tuple[Any, ...], out_dtype: torch.dtype) -> str | None:
    """Why the kernel cannot take one part, or None."""
    if x.dim() != 4 or x.dtype not in IN_DTYPES:
        return f"x must be (batch, seq, heads, head_dim) in {IN_DTYPES}, not {tuple(x.shape)} {x.dtype}"
    head_dim = x.shape[-1]
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim & (head_dim - 1) or x.stride(-1) != 1:
        return f"the head dim must be a power of two of contiguous entries, not {head_dim} at stride {x.stride(-1)}"
    if weight is not None and (tuple(weight.shape) != (head_dim,) or weight.stride(-1) != 1 or weight.dtype != x.dtype):
        return f"the weight must be ({head_dim},) contiguous in {x.dtype}, not {tuple(weight.shape)} {weight.dtype}"
    if out_dtype not in OUT_DTYPES:
        return f"the output dtype must be one of {OUT_DTYPES}, not {out_dtype}"
    for f in factors:
        if f.dtype != torch.float32 or not 1 <= f.dim() <= 4 or f.shape[-1] != head_dim or f.stride(-1) != 1:
            return f"each factor must be float32 with {head_dim} contiguous entries last, not {tuple(f.shape)}"
        lead = zip((1,) * (4 - f.dim()) + tuple(f.shape[:-1]), x.shape[:3], strict=True)
        if not all(statically_known_true(n == 1) or statically_known_true(n == m) for n, m in lead):
            return f"factors {tuple(f.shape)} do not broadcast to x's {tuple(x.shape)}"
    for t in (x, *factors):
        align = ALIGN_BYTES // t.element_size()
        if not all(statically_known_true(n % align == 0) for n in (t.storage_offset(), *_row_strides(t))):
            return f"each row of a {tuple(t.shape)} {t.dtype} input must start {ALIGN_BYTES}-byte aligned"
    return None


def per_part(factors: tuple[Any, ...], xs: list[Any]) -> list[tuple[Any, ...]] | None:
    """Factors given for the joint sequence of the parts `xs`, cut into each part's tokens (a view of
    each, `narrow` along the axis that broadcasts to x's seq; one that does not vary along it is each
    part's whole); None where one varies along it but does not span the joint sequence."""
    total = sum(x.shape[1] for x in xs)
    axes = [_seq_axis(f) for f in factors]
    spans = zip(factors, axes, strict=True)
    if any(axis is not None and not statically_known_true(f.shape[axis] == total) for f, axis in spans):
        return None
    cut, start = [], 0
    for x in xs:
        parts = zip(factors, axes, strict=True)
        cut.append(tuple(f if axis is None else f.narrow(axis, start, x.shape[1]) for f, axis in parts))
        start = start + x.shape[1]
    return cut


def checked(
    xs: list[Any], weights: list[Any], factors: list[tuple[Any, ...]], out_dtype: torch.dtype
) -> list[tuple[Any, ...]]:
    """The factors the kernel reads for the parts `xs`, one tuple a part ((cos, sin), or (pairs,) flattened
    to head_dim entries), where `factors` holds one a part or one for the joint sequence (`per_part`), with
    the parts checked (`problem`); real or fake tensors.

    Raises:
        ValueError: what the kernel cannot take, as `problem` says, or joint factors that do not span the
            parts' joint sequence.
    """
    if len(factors) == 1 and len(xs) == 2:
        cut = per_part(factors[0], xs)
        if cut is None:
            raise ValueError(f"norm_rope: factors {tuple(factors[0][0].shape)} do not span the parts' joint sequence")
        factors = cut
    trouble = problem(xs, weights, factors, out_dtype)
    if trouble:
        raise ValueError(f"norm_rope: {trouble}")
    return factors


def _seq_axis(f: Any) -> int | None:
    """The axis of `f` that broadcasts to x's seq in (batch, seq, heads, head_dim), None where it has none
    or is 1 long."""
    axis = f.dim() - 3
    return None if axis < 0 or statically_known_true(f.shape[axis] == 1) else axis


def _row_strides(f: torch.Tensor) -> tuple[Any, Any, Any]:
    """`f`'s strides over (batch, seq, heads) as x's rows read it: 0 where `f` broadcasts."""
    lead = [(1, 0)] * (4 - f.dim()) + list(zip(f.shape, f.stride(), strict=True))
    return tuple(0 if statically_known_true(n == 1) else stride for n, stride in lead[:3])


def _launch(
    xs: list[torch.Tensor],
    weights: list[torch.Tensor | None],
    eps: float,
    factors: list[tuple[torch.Tensor, ...]],
    out_dtype: torch.dtype,
    round_first: bool,
    complex_: bool,
) -> torch.Tensor:
    """The ops' body: `factors` one tuple a part or one for the joint sequence, (cos, sin), or (pairs,)
    where `complex_`."""
    stacked = checked(xs, weights, factors, out_dtype)
    if xs[0].device.type == "cpu" and not _INTERPRETED:
        parts = zip(xs, weights, stacked, strict=True)  # the complex form's `sin` is None
        return torch.cat([reference(x, w, eps, *(*f, None)[:2], out_dtype, round_first) for x, w, f in parts], 1)
    (x, *rest), (weight, *_) = xs, weights
    x2, weight2 = (rest[0], weights[1]) if rest else (x, weight)
    (cos, *sin), (cos2, *sin2) = stacked[0], stacked[-1]
    sin, sin2 = (sin[0], sin2[0]) if sin else (cos, cos2)  # the complex form reads its pairs from `cos` alone
    batch, seq, heads, head_dim = x.shape
    seq = seq + (x2.shape[1] if rest else 0)
    out = torch.empty((batch, seq, heads, head_dim), dtype=out_dtype, device=x.device)
    rows = batch * seq * heads
    # One config through `triton.autotune`, as sage.py launches its kernel in a package: nothing is tuned.
    kernel, config = (_norm_rope_kernel, CONFIG.all_kwargs()) if _INTERPRETED else (wrap_triton(_configured), {})
    kernel[lambda meta: (triton.cdiv(rows, meta["ROWS"]),)](
        x, x2, x if weight is None else weight, x2 if weight2 is None else weight2, cos, cos2, sin, sin2, out,
        rows, seq, x.shape[1], heads, *x.stride()[:3], *x2.stride()[:3],
        *_row_strides(cos), *_row_strides(cos2), *_row_strides(sin), *_row_strides(sin2), eps,
        HEAD_DIM=head_dim, HAS_WEIGHT=weight is not None, ROUND_FIRST=round_first, COMPLEX=complex_,
        SATURATE=out_dtype == torch.float8_e4m3fn, JOINED=bool(rest),
        ALIGN_X=ALIGN_BYTES // x.element_size(),
        ALIGN_F=ALIGN_BYTES // cos.element_size(),
        **config,
    )
    return out


@triton_op("aot_rope::norm_rope_real", mutates_args=())
def norm_rope_real(
    x: list[torch.Tensor],
    weight: list[torch.Tensor | None],
    eps: float,
    cos: list[torch.Tensor],
    sin: list[torch.Tensor],
    out_dtype: torch.dtype,
    round_first: bool = False,
) -> torch.Tensor:
    """The joint sequence of the parts `x` (one or two, each (batch, seq_i, heads, head_dim) bf16, float16
    or float32, head_dim a power of two, alike but for seq_i), each part RMS-normalized over each head
    (`weight` one per part, each (head_dim,) in x's dtype or each None, `eps`; `round_first`: rounded to
    x's dtype before the weight, as diffusers' `RMSNorm` computes it, else after, as `torch.nn.RMSNorm`),
    then each pair (e, o) of entries rotated as diffusers' `apply_rotary_emb` rotates it, (e cos_e - o sin_e,
    o cos_o + e sin_o): `cos` and `sin` one per part or one for the joint sequence (cut with `per_part`),
    float32 broadcastable to x's shape with their head_dim entries contiguous, each row of x and of them
    starting 16-byte aligned (`ALIGN_BYTES`). Returns a contiguous (batch, sum of seq_i, heads, head_dim)
    tensor in `out_dtype`, rounded to x's dtype first: bf16, float16 or float32, or float8_e4m3fn (saturated
    at +-448 as `fa3.unit_scaled` casts). With one part, `norm(x)` then RoPE; with two, as diffusers' FLUX
    double block computes `rope(cat([norm_1(x_1), norm_2(x_2)], 1))` or Qwen-Image's
    `cat([rope_1(norm_1(x_1)), rope_2(norm_2(x_2))], 1)`, without the `cat`.

    Raises:
        ValueError: tensors the kernel cannot take (`problem` says which).
    """
    if len(cos) != len(sin):
        raise ValueError(f"norm_rope: cos and sin must come alike, one per part or one, not {len(cos)} and {len(sin)}")
    return _launch(x, weight, eps, list(zip(cos, sin, strict=True)), out_dtype, round_first, complex_=False)


@triton_op("aot_rope::norm_rope_complex", mutates_args=())
def norm_rope_complex(
    x: list[torch.Tensor],
    weight: list[torch.Tensor | None],
    eps: float,
    pairs: list[torch.Tensor],
    out_dtype: torch.dtype,
    round_first: bool = False,
) -> torch.Tensor:
    """As `norm_rope_real`, with each pair multiplied as a complex number (e + i o)(cos + i sin): `pairs`
    one per part or one for the joint sequence, each float32 (..., head_dim / 2, 2), the `view_as_real`
    of the complex factors, broadcastable to x's shape as pairs, each pair's (cos, sin) contiguous and the
    pairs too.

    Raises:
        ValueError: tensors the kernel cannot take (`problem` says which).
    """
    if any(f.dim() < 2 or f.shape[-1] != 2 for f in pairs):
        raise ValueError(f"norm_rope: pairs must be (..., head_dim / 2, 2), not {[tuple(f.shape) for f in pairs]}")
    return _launch(x, weight, eps, [(f.flatten(-2),) for f in pairs], out_dtype, round_first, complex_=True)

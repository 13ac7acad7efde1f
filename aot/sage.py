"""SageAttention's recipe in Triton: INT8 Q·K^T, FP8 P·V, for GPUs without FlashAttention-3.

ZeroGPU's RTX Pro 6000 (sm_120) cannot run FA3 (a Hopper kernel). This module's kernel computes
attention the way SageAttention 2 does (Zhang et al., 2024, arXiv:2411.10958): Q and K as INT8 with
one scale per token and head, their product exact in int32; the softmax in float32, online, as
FlashAttention's; its probabilities P as FP8 (e4m3, scaled by `P_SCALE` so that the small ones keep
their digits) against V as FP8 scaled per head. Each matmul runs at the tensor cores' 8-bit rate,
twice their bf16 rate on Hopper (on sm_120 not measured here). SageAttention also subtracts K's mean over the
tokens (which softmax does not see) before quantizing it; here K is quantized as it is, and each
block's trial (export.py's `_attention_note`) bounds the error that leaves.

`sage_forward` is a `torch.library.triton_op`, so `torch.export` traces into the kernel and
AOTInductor compiles it into the block's package with the rest of the graph; the quantization
(`quantize_per_token`, fa3.py's `quantize_per_head`) runs in the block's own graph, where Inductor
fuses it into the kernels that make Q, K and V. Triton compiles the kernel for the GPU it runs on
(it needs FP8 tensor cores: compute capability >= 8.9); `TRITON_INTERPRET=1` runs it on a CPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from aot.fa3 import quantize_per_head

# P (0..1 after the running max is taken out) times this before its cast to e4m3: the largest p is
# then e4m3's largest value, and p down to 2^-6 / P_SCALE stays a normal number (SageAttention 2's scale).
P_SCALE = tl.constexpr(448.0)
# V's rows of tokens are padded to a multiple of this many (`tokens_innermost`), so that each starts
# 16-byte aligned, and the kernel says so (`tl.multiple_of`): its vector loads need it, and a
# package's compiler cannot prove it of a token count known only at run time. Without it, the kernel
# in a package ran 2.2x slower on an H100 (0.99 against 0.46 ms a call).
TOKEN_ALIGN = 16
# INT8's symmetric range: a token's abs-max in a head maps to it (`quantize_per_token`).
INT8_MAX = 127.0
# Tile sizes and launch settings tried when a package is compiled (Triton's autotuner keeps the fastest
# on the GPU at hand). M: queries per program, N: keys per step. In the H100's order at FLUX.1-dev's
# shape: 0.43, 0.47, 0.58, 0.69 ms a call (2026-12-06); each fits sm_120's shared memory at head dim 128.
CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
    for m, n, w, s in ((64, 128, 4, 3), (64, 128, 4, 2), (128, 128, 4, 3), (128, 64, 8, 3))
]


# The head dims the kernel takes: a power of two (its tiles), at least 32 (Triton's smallest depth of an
# 8-bit matmul on NVIDIA GPUs), at most 128 (at 256 most configs overflow sm_120's shared memory).
HEAD_DIMS = (32, 64, 128)


def head_dim_problem(head_dim: int) -> str | None:
    """Why the kernel cannot take heads of `head_dim` entries (`HEAD_DIMS`), or None."""
    if head_dim in HEAD_DIMS:
        return None
    return f"sage attention takes head dims {', '.join(map(str, HEAD_DIMS))}; this model's is {head_dim}"


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (batch, seq, heads, head_dim), any float dtype, as int8 with one scale per batch, token and
    head, its abs-max over the head dim mapped to `INT8_MAX`. Returns the int8 tensor (same shape) and
    the scale, float32 (batch, seq, heads): x ~= int8 * scale, each entry within scale / 2. An all-zero
    row gets scale 1. The reduction runs over each row of head_dim entries, so Inductor computes it in
    the kernel that makes `x`."""
    amax = x.abs().amax(dim=-1).float()
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    return (x.float() / scale[..., None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


@triton.jit
def _keys(
    acc, m_i, l_i, q, q_scale, k_ptrs, ks_ptrs, v_ptrs, offs_n, start, stop,
    stride_ks, stride_kss, stride_vs, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The online softmax over keys `start`..`stop` in steps of BLOCK_N; MASKED where the one step
    runs past the last key."""
    for start_n in range(start, stop, BLOCK_N):
        if MASKED:
            n_ok = start_n + offs_n < stop
            k = tl.load(k_ptrs + start_n * stride_ks, mask=n_ok[:, None], other=0)
            k_scale = tl.load(ks_ptrs + start_n * stride_kss, mask=n_ok, other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vs, mask=n_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs + start_n * stride_ks)
            k_scale = tl.load(ks_ptrs + start_n * stride_kss)
            v = tl.load(v_ptrs + start_n * stride_vs)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * q_scale[:, None] * k_scale[None, :]
        if MASKED:
            s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot((p * P_SCALE).to(tl.float8e4nv), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _sage_attention_kernel(
    Q, K, V, QS, KS, VS, Out,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_qsb, stride_qss, stride_qsh, stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vsh,
    stride_ob, stride_os, stride_oh,
    heads, group, seq_q, seq_k, qk_scale,
    HEAD_DIM: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M queries of one batch entry and head against every key. Q, K int8 and V
    FP8 with their scales (`sage_forward`); qk_scale: the softmax scale times log2(e)."""
    start_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    kv = h // group
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    m_ok = offs_m < seq_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :], mask=m_ok[:, None])
    # AOTInductor passes a Python float as fp64: cast, or the whole softmax would run in fp64.
    q_scale = tl.load(QS + b * stride_qsb + h * stride_qsh + offs_m * stride_qss, mask=m_ok, other=0.0)
    q_scale *= tl.cast(qk_scale, tl.float32)
    k_ptrs = K + b * stride_kb + kv * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    ks_ptrs = KS + b * stride_ksb + kv * stride_ksh + offs_n * stride_kss
    # Each of V's rows of tokens starts ALIGN-aligned (`tokens_innermost`, checked by `sage_forward`);
    # said here, as a package's compiler cannot see it in the strides of a run-time token count.
    v_rows = tl.multiple_of(b * stride_vb + kv * stride_vh + offs_d * stride_vd, ALIGN)
    v_ptrs = V + v_rows[None, :] + offs_n[:, None] * stride_vs
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    whole = seq_k // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _keys(
        acc, m_i, l_i, q, q_scale, k_ptrs, ks_ptrs, v_ptrs, offs_n, 0, whole,
        stride_ks, stride_kss, stride_vs, False, BLOCK_N,
    )
    if whole < seq_k:
        acc, m_i, l_i = _keys(
            acc, m_i, l_i, q, q_scale, k_ptrs, ks_ptrs, v_ptrs, offs_n, whole, seq_k,
            stride_ks, stride_kss, stride_vs, True, BLOCK_N,
        )
    v_scale = tl.load(VS + b * stride_vsb + kv * stride_vsh)
    out = acc * (v_scale / P_SCALE) / l_i[:, None]
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None])


_tuned = triton.autotune(CONFIGS, key=["HEAD_DIM"])(_sage_attention_kernel)
# Triton's interpreter (TRITON_INTERPRET=1, a CPU) has no timer to autotune with: the first config.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton_op("aot_sage::forward", mutates_args=())
def sage_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_descale: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Attention on 8-bit inputs: `q` int8 (batch, seq_q, heads, head_dim), `k` int8 (batch, seq_k,
    kv_heads, head_dim), each head's entries contiguous; `v` float8_e4m3fn (batch, seq_k or more,
    kv_heads, head_dim), its tokens innermost (`tokens_innermost`); `q_scale` (batch, seq_q, heads),
    `k_scale` (batch, seq_k, kv_heads) and `v_descale` (batch, kv_heads), float32, what each input is
    multiplied back by (`quantize_per_token`, `quantize_per_head`); `softmax_scale` multiplies
    Q·K^T. Returns bf16 (batch, seq_q, heads, head_dim), contiguous.

    Raises:
        ValueError: a head dim not in `HEAD_DIMS`, heads not a multiple of kv_heads, or inputs laid
            out otherwise.
    """
    batch, seq_q, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    problem = head_dim_problem(head_dim)
    if problem or heads % kv_heads:
        raise ValueError(problem or f"sage attention: {heads} query heads are not a multiple of {kv_heads} key heads")
    v_rows = (v.stride(0), v.stride(2), v.stride(3))
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(1) != 1 or any(n % TOKEN_ALIGN for n in v_rows):
        raise ValueError(
            "sage attention reads Q and K with the head dim innermost and V with the tokens innermost, "
            f"in rows of a multiple of {TOKEN_ALIGN} (`tokens_innermost`)"
        )
    out = q.new_empty(q.shape, dtype=torch.bfloat16)

    def grid(meta: dict[str, Any]) -> tuple[Any, ...]:
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * heads)

    # wrap_triton lets torch.export trace the launch; the interpreter's kernels are not JIT functions.
    kernel, config = (_sage_attention_kernel, CONFIGS[0].all_kwargs()) if _INTERPRETED else (wrap_triton(_tuned), {})
    kernel[grid](**kernel_arguments(q, k, v, q_scale, k_scale, v_descale, out, softmax_scale), **config)
    return out


def kernel_arguments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_descale: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: float,
) -> dict[str, Any]:
    """The kernel's arguments by name, but for its tiles (`CONFIGS`), for `sage_forward`'s inputs and
    its output `out` (bf16, `q`'s shape)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    values = (
        *(q, k, v, q_scale, k_scale, v_descale, out),
        *q.stride()[:3], *k.stride()[:3], *v.stride(), *q_scale.stride(), *k_scale.stride(), *v_descale.stride(),
        *out.stride()[:3],
        *(heads, heads // kv_heads, q.shape[1], k.shape[1], softmax_scale * 1.4426950408889634),
    )
    names = _sage_attention_kernel.arg_names[: len(values)]  # then its constants: HEAD_DIM, ALIGN, the tiles
    return {**dict(zip(names, values, strict=True)), "HEAD_DIM": q.shape[3], "ALIGN": TOKEN_ALIGN}


def sage_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
) -> torch.Tensor:
    """Attention with diffusers' native backend signature (`query` (batch, seq, heads, head_dim),
    bf16 or float16; `key`, `value` (batch, seq_k, kv_heads, head_dim), grouped queries whatever
    `enable_gqa` says): Q and K quantized per token (`quantize_per_token`), V per head, then
    `sage_forward`. Output in `query`'s dtype.

    Raises:
        ValueError: a mask, dropout, causal attention or the log-sum-exp was asked for (not
            supported), or what `sage_forward` refuses (head dim, heads).
    """
    if attn_mask is not None or dropout_p or is_causal or return_lse:
        raise ValueError("sage attention supports no mask, no dropout, no causal attention and no returned log-sum-exp")
    return sage_forward(*quantized(query, key, value, scale)).to(query.dtype)


def quantized(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> tuple[Any, ...]:
    """`sage_forward`'s arguments for attention over `query` (batch, seq, heads, head_dim), `key` and
    `value` (batch, seq_k, kv_heads, head_dim), any float dtype, at softmax `scale` (None: 1/sqrt(head_dim)):
    Q and K per token (`quantize_per_token`), V per head and tokens innermost (`tokens_innermost`)."""
    (q, q_scale), (k, k_scale) = quantize_per_token(query), quantize_per_token(key)
    v, v_descale = quantize_per_head(value)
    softmax_scale = query.shape[-1] ** -0.5 if scale is None else scale
    return q, k, tokens_innermost(v), q_scale, k_scale, v_descale, softmax_scale


def tokens_innermost(v: torch.Tensor) -> torch.Tensor:
    """`v` (batch, seq, heads, head_dim) stored as (batch, heads, head_dim, seq padded with zeros to a
    multiple of `TOKEN_ALIGN`), returned as a (batch, padded seq, heads, head_dim) view: what
    `sage_forward` reads V as. FP8 tensor cores take P·V's operands with the summed dim (tokens)
    innermost; V as (batch, seq, heads, head_dim) made the kernel 3.6x slower (H100, BENCHMARKS.md).
    The view is not cut back to seq (the keys say how many tokens the kernel reads): torch.export
    would have to prove padded >= seq, which it cannot for a symbolic count."""
    seq, align = v.shape[1], TOKEN_ALIGN
    padded = align * ((seq + align - 1) // align)  # written so that a symbolic token count still shows it
    # A clone, not .contiguous(): export takes pad's output as contiguous and would drop the latter, but
    # eager pad by 0 (a token count already aligned) returns the permuted view as it is.
    rows = torch.nn.functional.pad(v.permute(0, 2, 3, 1), (0, padded - seq))
    return rows.clone(memory_format=torch.contiguous_format).permute(0, 3, 1, 2)

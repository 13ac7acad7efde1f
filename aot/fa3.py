"""FlashAttention-3: loaded from the kernels Hub or an importable module, and called by the exported
blocks through a registered custom op, in bf16 (`fa3`) or with FP8 inputs (`fa3-fp8`).

`fa3`: diffusers' `_flash_3` attention backend, whose op `_diffusers_flash_attn_3::_flash_attn_forward`
has a fake implementation, so a block exports as one graph and the package calls that op at run
time; a mask of one value per token (Chroma's) is folded into the head dim first (`fold_token_mask`).
`fa3-fp8`: the same kernel's FP8 forward through this module's op `aot_fa3::fp8_forward`. The
blocks cast Q, K and V to FP8 in their own graph (`fp8_attention`), where Inductor fuses the casts
into the kernels that make them, so the op reads FP8 and writes bf16.

Q and K are cast unscaled: RMS-normalized per head, then rotated (RoPE keeps each pair's norm), no
entry exceeds sqrt(head_dim) x the norm's largest weight, which `unit_scale_problem` checks against
FP8's range for every block. A scale from their abs-max would cost a pass over each before the cast
can start: 4 ms of a FLUX.1-dev step on an H100, most of what the FP8 kernel saves (BENCHMARKS.md).
V, unnormalized, is scaled per head (`quantize_per_head`).
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any

import torch

from aot.blocks import repeated_blocks

# kernels-community/flash-attn3's major version: the one diffusers 0.42 pins for its FA3 backend.
FA3_KERNEL_VERSION = 1
# The attention kernels that call FA3 (`attention` in plans.py and the fingerprint): bf16, FP8 inputs.
FA3_KERNELS = ("fa3", "fa3-fp8")
# float8_e4m3fn's largest finite value: a head's abs-max maps to it (`quantize_per_head`).
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


@functools.cache
def load_fa3(source: str) -> Any:
    """Load FlashAttention-3 and hand it to diffusers' `_flash_3` attention backend (and so to
    `fp8_forward`).

    `source` is a Hub kernel repo (`owner/name`, fetched by `kernels.get_kernel` at
    `FA3_KERNEL_VERSION`) or the name of an importable module providing `flash_attn_func`
    (e.g. `fa3_fwd_interface` from the PyPI wheel `fa3-fwd`).

    Loads once per process (a failed load is tried again at the next call).

    Raises:
        ImportError, OSError, RuntimeError: the kernel cannot be found or loaded.
    """
    from diffusers.models import attention_dispatch  # heavy: at first use

    if "/" in source:
        from kernels import get_kernel  # at first use: only a Hub kernel needs it

        module = get_kernel(source, version=FA3_KERNEL_VERSION)
    else:
        module = importlib.import_module(source)
    # diffusers looks for FA3 only once, as a module named `flash_attn_interface` at its import;
    # these two names are what that detection sets.
    attention_dispatch.flash_attn_3_func = module.flash_attn_func
    attention_dispatch._CAN_USE_FLASH_ATTN_3 = True
    return module


@torch.library.custom_op("aot_fa3::fp8_forward", mutates_args=(), device_types="cuda")
def fp8_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """FA3's forward on FP8 inputs: `q` (batch, seq_q, heads, head_dim), `k`, `v` (batch, seq_k,
    kv_heads, head_dim), all float8_e4m3fn; each `*_descale` float32 (batch, kv_heads), what the
    kernel multiplies its input back by. Returns bf16 (batch, seq_q, heads, head_dim). FA3 also
    rounds the softmax's probabilities to FP8 before they meet V.

    Raises:
        RuntimeError: no FA3 kernel was loaded in this process (`load_fa3`).
    """
    from diffusers.models import attention_dispatch  # heavy: at first use

    if not getattr(attention_dispatch, "_CAN_USE_FLASH_ATTN_3", False):
        raise RuntimeError("aot_fa3::fp8_forward: no FA3 kernel loaded in this process (aot.fa3.load_fa3)")
    out = attention_dispatch.flash_attn_3_func(
        q, k, v, softmax_scale=softmax_scale, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale
    )
    return out[0] if isinstance(out, tuple) else out


@fp8_forward.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, softmax_scale=None):
    return q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=torch.bfloat16)


def quantize_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (batch, seq, heads, head_dim), any float dtype, as float8_e4m3fn scaled per batch and
    head so that each head's abs-max maps to `E4M3_MAX`. Returns the FP8 tensor (same shape) and
    its descale, float32 (batch, heads): x ~= fp8 * descale. An all-zero head gets descale 1."""
    # In two steps: over each head's row first (contiguous, fused into the kernel that makes `x`),
    # then over the tokens' row maxima (batch x seq x heads values).
    amax = x.abs().amax(dim=-1).float().amax(dim=1)
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x.float() / descale[:, None, :, None]).to(torch.float8_e4m3fn), descale


def fp8_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
) -> torch.Tensor:
    """Attention with diffusers' backend signature (`query` (batch, seq, heads, head_dim), bf16):
    Q and K cast to FP8 unscaled (`unit_scaled`), V scaled per head (`quantize_per_head`), then
    `fp8_forward`. Output in `query`'s dtype.

    Raises:
        ValueError: a mask, causal attention or the log-sum-exp was asked for (not supported).
    """
    if attn_mask is not None or is_causal or return_lse:
        raise ValueError("fa3-fp8 attention supports no mask, no causal attention and no returned log-sum-exp")
    v, v_descale = quantize_per_head(value)  # (batch, kv_heads): FA3's descale shape for all three
    unit = torch.ones_like(v_descale)
    q, k = (unit_scaled(t) for t in (query, key))
    return fp8_forward(q, k, v, unit, unit, v_descale, scale).to(query.dtype)


def fa3_attention(
    flash_3: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    **options: Any,
) -> torch.Tensor:
    """diffusers' bf16 FA3 backend `flash_3`, which takes no mask, called as diffusers' dispatcher
    calls it (`query` (batch, seq, heads, head_dim); `options`: the rest of its arguments, e.g.
    `is_causal`): without a mask it is `flash_3`; a mask of one value per token is folded into the
    head dim (`fold_token_mask`) and the padding cut from the output.

    Raises:
        ValueError: a mask `fold_token_mask` cannot fold, or a mask with causal attention or the
            log-sum-exp.
    """
    if attn_mask is None:
        return flash_3(query=query, key=key, value=value, scale=scale, **options)
    if options.get("is_causal") or options.get("return_lse"):
        raise ValueError("fa3 attention with a mask supports no causal attention and no returned log-sum-exp")
    q, k, v, scale = fold_token_mask(query, key, value, attn_mask, scale)
    parallel = options.get("_parallel_config")
    return flash_3(query=q, key=k, value=v, scale=scale, _parallel_config=parallel)[..., : value.shape[-1]]


# Entries `fold_token_mask` adds to each head: the mask's, then zeros to the next multiple of 8 (FA3's head dims).
FOLDED = 8
# FA3's largest head dim (its kernels: 64, 96, 128, 192, 256).
FA3_MAX_HEAD_DIM = 256


def fold_token_mask(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """An additive mask m_i m_j, one value m in {0, 1} per token, folded into one more entry per head:
    q'_i = [q_i, m_i / scale, 0...], k'_j = [k_j, m_j, 0...], v' = [v, 0...], `FOLDED` entries more,
    so that scale q'_i . k'_j = scale q_i . k_j + m_i m_j and a kernel without masks computes the
    masked attention. That is the mask of diffusers 0.42's Chroma blocks: their padding mask times
    itself, (batch, 1, seq, seq), added to the scores.

    `query`, `key`, `value`: (batch, seq, heads, head_dim), one sequence (self-attention);
    `attn_mask`: floating, (batch, 1, seq, seq); `scale`: the softmax scale, None for 1/sqrt(head_dim).
    Returns q', k', v' (head_dim + `FOLDED`), and the scale to pass with them. m is read from the
    mask's diagonal (m_i m_i = m_i): the fold relies on the mask being built as m_i m_j. The values
    are not checked (they are unknown while a block is exported); a mask of another form gives
    another result, which the trial's parity check against eager sees only where the captured
    calls' masks show it. m_i / scale is rounded to `query`'s dtype: within 2^-9 of the added 1 in
    bf16 (1e-4 at head dim 128).

    Raises:
        ValueError: the mask is boolean, or not (batch, 1, seq, seq) for these queries and keys, or
            the head dim is above `FA3_MAX_HEAD_DIM` - `FOLDED`.
    """
    batch, seq = query.shape[:2]
    if not attn_mask.is_floating_point() or tuple(attn_mask.shape) != (batch, 1, seq, seq) or key.shape[1] != seq:
        raise ValueError(
            f"fa3 attention folds only an additive float mask (batch, 1, seq, seq) over one sequence; got "
            f"a {attn_mask.dtype} mask of shape {tuple(attn_mask.shape)} for {seq} queries and {key.shape[1]} keys"
        )
    if query.shape[-1] + FOLDED > FA3_MAX_HEAD_DIM:
        raise ValueError(
            f"fa3 attention folds a mask into head dims up to {FA3_MAX_HEAD_DIM - FOLDED} "
            f"(FA3 takes {FA3_MAX_HEAD_DIM}); this model's is {query.shape[-1]}"
        )
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    m = attn_mask.diagonal(dim1=-2, dim2=-1).transpose(1, 2).unsqueeze(-1)  # (batch, seq, 1, 1)
    pad = torch.nn.functional.pad  # zeros after the last dim's entries
    q = pad(torch.cat([query, (m.to(query.dtype) / scale).expand(*query.shape[:-1], 1)], -1), (0, FOLDED - 1))
    k = pad(torch.cat([key, m.to(key.dtype).expand(*key.shape[:-1], 1)], -1), (0, FOLDED - 1))
    return q, k, pad(value, (0, FOLDED)), scale


def unit_scaled(x: torch.Tensor) -> torch.Tensor:
    """`x` as float8_e4m3fn without a scale, saturated at +-`E4M3_MAX` (torch's cast does not
    saturate: a larger value would become NaN). For Q and K within `unit_scale_problem`'s bound."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def unit_scale_problem(transformer: torch.nn.Module) -> str | None:
    """Why `fa3-fp8` cannot cast the queries and keys of `transformer`'s repeated blocks to FP8
    unscaled (`unit_scaled`), or None.

    A norm over n entries (RMS or layer norm) leaves none above sqrt(n) in size before its weight
    (their squares average to 1); its weight and bias then bound each entry, and each pair of
    entries, which RoPE rotates keeping the pair's length, by sqrt(n) x the largest weight +
    sqrt(2) x the largest bias. A block passes where each attention module in it (a module with a
    `norm_q`) normalizes its queries and keys (`norm_q`, `norm_k`, and `norm_added_q`, `norm_added_k`
    beside text projections, `add_q_proj`) and every such bound is within `E4M3_MAX`: a largest
    weight of 39.6 for a per-head norm at head dim 128. Anything else a block does between norm and
    attention is left to the trial's parity check. Reads the weights: call it where they are loaded.
    """
    paths = {id(module): path for path, module in transformer.named_modules()}
    for found in repeated_blocks(transformer).values():
        for block in found:
            problem = _block_problem(block, paths[id(block)])
            if problem:
                return problem
    return None


def _block_problem(block: torch.nn.Module, at: str) -> str | None:
    """`unit_scale_problem` for one block, at path `at` in the transformer, which its message names."""
    attentions = {path: m for path, m in block.named_modules() if hasattr(m, "norm_q")}
    if not attentions:
        return f"{at} ({type(block).__name__}) has no attention module with a query norm (norm_q)"
    for path, attention in attentions.items():
        text = getattr(attention, "add_q_proj", None) is not None
        for part in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            norm, where = getattr(attention, part, None), ".".join(p for p in (at, path, part) if p)
            if norm is None:
                if part in ("norm_q", "norm_k") or text:
                    return f"{where} is missing: its queries or keys are not normalized"
                continue
            bound = _output_bound(norm)
            if bound is None:
                return f"{where}: cannot tell how many entries {type(norm).__name__} normalizes over"
            if bound > E4M3_MAX:
                return f"{where}: its outputs may reach {bound:.0f}, beyond FP8's {E4M3_MAX:.0f}"
    return None


def _output_bound(norm: torch.nn.Module) -> float | None:
    """sqrt(n) x the largest weight + sqrt(2) x the largest bias (`unit_scale_problem`), n the
    entries `norm` normalizes over (torch's `normalized_shape`, diffusers' `dim`); None where
    neither is there."""
    shape = getattr(norm, "normalized_shape", None) or getattr(norm, "dim", None)
    if shape is None:
        return None
    entries = math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else int(shape)
    weight, bias = (getattr(norm, part, None) for part in ("weight", "bias"))
    largest = 1.0 if weight is None else weight.detach().abs().max().item()
    shift = 0.0 if bias is None else bias.detach().abs().max().item()
    return entries**0.5 * largest + 2**0.5 * shift

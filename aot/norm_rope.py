"""Each head's RMS norm and RoPE in one Triton kernel of our own, written into an exported graph in place
of the ops diffusers computes them with (`fuse_norm_rope`, which `lowering.decomposed` runs where the plan
or `norm_rope=on` asks, before `rotations.flip_pair_rotations`).

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

The ops, for x (batch, seq, heads, head_dim) bf16, float16 or float32 with the head dim contiguous:
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

from aot.rotations import complex_product, is_call, stacked_pairs

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
    X, W, C, S, Out,
    rows, seq, heads,
    stride_xb, stride_xs, stride_xh,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
    eps,
    HEAD_DIM: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND_FIRST: tl.constexpr, COMPLEX: tl.constexpr,
    SATURATE: tl.constexpr, ROWS: tl.constexpr, ALIGN_X: tl.constexpr, ALIGN_F: tl.constexpr,
):
    """ROWS head rows a program: their RMS norm (ROUND_FIRST: rounded to x's dtype before the weight, as
    diffusers' `RMSNorm` computes it), then each pair (e, o) rotated by its factors (`C`, `S` one value an
    entry; COMPLEX: `C` holds (cos, sin) a pair, `S` unused), rounded to x's dtype, then to `Out`'s
    (SATURATE: clamped to +-448 first, as `fa3.unit_scaled` does). Each row of x starts a multiple of
    ALIGN_X entries in, each row of the factors of ALIGN_F (`problem` checks: 16 bytes), said to the
    compiler, which cannot see it in a stride that follows the token count, so that a row loads 16 bytes
    at a time: without it, x loads two bytes at a time (the PTX sm_90 gets, tests/test_norm_rope.py)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < rows
    h, s, b = r % heads, (r // heads) % seq, r // (heads * seq)
    d = tl.arange(0, HEAD_DIM)
    x_rows = tl.multiple_of(b * stride_xb + s * stride_xs + h * stride_xh, ALIGN_X)
    c_rows = tl.multiple_of(b * stride_cb + s * stride_cs + h * stride_ch, ALIGN_F)
    x = tl.load(X + x_rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    xf = x.to(tl.float32)
    # AOTInductor passes a Python float as fp64: cast, or the norm would run in fp64.
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + tl.cast(eps, tl.float32))
    normed = xf * inv[:, None]
    if ROUND_FIRST:
        normed = normed.to(x.dtype).to(tl.float32)
    if HAS_WEIGHT:
        normed = normed * tl.load(W + d).to(tl.float32)[None, :]
    normed = normed.to(x.dtype).to(tl.float32)  # the norm's output, rounded as torch rounds it
    e, o = tl.split(tl.reshape(normed, (ROWS, HEAD_DIM // 2, 2)))
    c = tl.load(C + c_rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    if COMPLEX:  # (e + i o)(c + i s)
        cos, sin = tl.split(tl.reshape(c.to(tl.float32), (ROWS, HEAD_DIM // 2, 2)))
        out = tl.join(e * cos - o * sin, o * cos + e * sin)
    else:  # x cos + stack(-o, e) sin, one factor an entry
        s_rows = tl.multiple_of(b * stride_sb + s * stride_ss + h * stride_sh, ALIGN_F)
        s_ = tl.load(S + s_rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        cos_e, cos_o = tl.split(tl.reshape(c.to(tl.float32), (ROWS, HEAD_DIM // 2, 2)))
        sin_e, sin_o = tl.split(tl.reshape(s_.to(tl.float32), (ROWS, HEAD_DIM // 2, 2)))
        out = tl.join(e * cos_e - o * sin_e, o * cos_o + e * sin_o)
    out = tl.reshape(out, (ROWS, HEAD_DIM)).to(x.dtype)
    if SATURATE:  # NaN stays NaN, as torch's clamp keeps it
        out = tl.maximum(out.to(tl.float32), -448.0, propagate_nan=tl.PropagateNan.ALL)
        out = tl.minimum(out, 448.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(Out + r[:, None] * HEAD_DIM + d[None, :], out.to(Out.dtype.element_ty), mask=ok[:, None])


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


def problem(x: Any, weight: Any, factors: tuple[Any, ...], out_dtype: torch.dtype) -> str | None:
    """Why the kernel cannot take these tensors (real or fake; `factors` (cos, sin) or (pairs,)), or None."""
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
        if f.dtype != torch.float32 or f.dim() > 4 or f.shape[-1] != head_dim or f.stride(-1) != 1:
            return f"each factor must be float32 with {head_dim} contiguous entries last, not {tuple(f.shape)}"
        lead = zip((1,) * (4 - f.dim()) + tuple(f.shape[:-1]), x.shape[:3], strict=True)
        if not all(statically_known_true(n == 1) or statically_known_true(n == m) for n, m in lead):
            return f"factors {tuple(f.shape)} do not broadcast to x's {tuple(x.shape)}"
    for t in (x, *factors):
        align = ALIGN_BYTES // t.element_size()
        if not all(statically_known_true(n % align == 0) for n in (t.storage_offset(), *_row_strides(t))):
            return f"each row of a {tuple(t.shape)} {t.dtype} input must start {ALIGN_BYTES}-byte aligned"
    return None


def _row_strides(f: torch.Tensor) -> tuple[Any, Any, Any]:
    """`f`'s strides over (batch, seq, heads) as x's rows read it: 0 where `f` broadcasts."""
    lead = [(1, 0)] * (4 - f.dim()) + list(zip(f.shape, f.stride(), strict=True))
    return tuple(0 if statically_known_true(n == 1) else stride for n, stride in lead[:3])


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor | None,
    out_dtype: torch.dtype,
    round_first: bool,
) -> torch.Tensor:
    trouble = problem(x, weight, (cos,) if sin is None else (cos, sin), out_dtype)
    if trouble:
        raise ValueError(f"norm_rope: {trouble}")
    if x.device.type == "cpu" and not _INTERPRETED:
        return reference(x, weight, eps, cos, sin, out_dtype, round_first)
    batch, seq, heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = batch * seq * heads
    # One config through `triton.autotune`, as sage.py launches its kernel in a package: nothing is tuned.
    kernel, config = (_norm_rope_kernel, CONFIG.all_kwargs()) if _INTERPRETED else (wrap_triton(_configured), {})
    second = cos if sin is None else sin  # the complex form reads its pairs from `cos` alone
    kernel[lambda meta: (triton.cdiv(rows, meta["ROWS"]),)](
        x, x if weight is None else weight, cos, second, out,
        rows, seq, heads, *x.stride()[:3], *_row_strides(cos), *_row_strides(second), eps,
        HEAD_DIM=head_dim, HAS_WEIGHT=weight is not None, ROUND_FIRST=round_first, COMPLEX=sin is None,
        SATURATE=out_dtype == torch.float8_e4m3fn,
        ALIGN_X=ALIGN_BYTES // x.element_size(),
        ALIGN_F=ALIGN_BYTES // cos.element_size(),
        **config,
    )
    return out


@triton_op("aot_rope::norm_rope_real", mutates_args=())
def norm_rope_real(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_dtype: torch.dtype,
    round_first: bool = False,
) -> torch.Tensor:
    """`x` (batch, seq, heads, head_dim) bf16, float16 or float32, head_dim a power of two, RMS-normalized
    over each head (`weight` (head_dim,) in x's dtype or None, `eps`; `round_first`: rounded to x's dtype
    before the weight, as diffusers' `RMSNorm` computes it, else after, as `torch.nn.RMSNorm`), then each
    pair (e, o) of entries rotated as diffusers' `apply_rotary_emb` rotates it, (e cos_e - o sin_e,
    o cos_o + e sin_o), `cos` and `sin` float32 broadcastable to x's shape with their head_dim entries
    contiguous, each row of x and of them starting 16-byte aligned (`ALIGN_BYTES`). Returns a contiguous
    tensor of x's shape in `out_dtype`: x's dtype, or float8_e4m3fn (rounded to x's dtype first, then
    saturated at +-448 as `fa3.unit_scaled` casts).

    Raises:
        ValueError: tensors the kernel cannot take (`problem` says which).
    """
    return _launch(x, weight, eps, cos, sin, out_dtype, round_first)


@triton_op("aot_rope::norm_rope_complex", mutates_args=())
def norm_rope_complex(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    pairs: torch.Tensor,
    out_dtype: torch.dtype,
    round_first: bool = False,
) -> torch.Tensor:
    """As `norm_rope_real`, with each pair multiplied as a complex number (e + i o)(cos + i sin): `pairs`
    float32 (..., head_dim / 2, 2), the `view_as_real` of the complex factors, broadcastable to x's shape
    as pairs, each pair's (cos, sin) contiguous and the pairs too.

    Raises:
        ValueError: tensors the kernel cannot take (`problem` says which).
    """
    return _launch(x, weight, eps, pairs.flatten(-2), None, out_dtype, round_first)


def fuse_norm_rope(module: torch.fx.GraphModule) -> int:
    """Write each per-head RMS norm that only RoPE reads, with that rotation (and the FP8 cast after it,
    where there is one), as one `norm_rope_real` or `norm_rope_complex` call in `module`'s graph.

    A site is taken where an RMS norm (`aten.rms_norm`, or diffusers' `RMSNorm` as its ops) normalizes
    each head of a (batch, seq, heads, head_dim) tensor; nothing but one rotation of pairs reads its
    output n, in diffusers' real form, `n.float() * cos + stack([-o, e], -1).flatten().float() * sin`, or
    the complex form, `view_as_real(view_as_complex(n.float() as pairs) * f).flatten()` (`rotations`),
    rounded back to n's dtype; what reads the rotated tensor is attention itself (aten's SDPA or a custom
    op, through views, or through `fa3.unit_scaled`'s saturated FP8 cast, which the call then makes);
    and `problem` has nothing against the tensors. Elsewhere Inductor's own kernel keeps what it fuses
    after the rotation (a `cat` of text and image heads, sage's INT8 quantization), so the site is left.

    Returns how many it rewrote; `module` is recompiled where any was."""
    graph = module.graph
    rewritten = 0
    sites = [site for node in graph.nodes if (site := _real_site(node) or _complex_site(node))]
    for (normed, (x, weight, eps, round_first)), factors, end in sites:
        out_dtype, end = _saturated_cast(end)
        inside = _feeding(normed, end)
        if inside is None or not _read_by_attention(end) or not _same_shape(end, x):
            continue
        complex_ = len(factors) == 1
        parts = torch.view_as_real(factors[0].meta["val"]) if complex_ else None  # each pair's (cos, sin)
        values = (parts.flatten(-2),) if complex_ else tuple(t.meta["val"] for t in factors)  # as the kernel reads
        if problem(x.meta["val"], None if weight is None else weight.meta["val"], values, out_dtype):
            continue
        with graph.inserting_before(end):
            if complex_:
                factors = (graph.call_function(aten.view_as_real.default, factors),)
                factors[0].meta["val"] = parts
            op = norm_rope_complex if complex_ else norm_rope_real
            fused = graph.call_function(op._opoverload, (x, weight, eps, *factors, out_dtype, round_first))
            fused.meta["val"] = x.meta["val"].new_empty(x.meta["val"].shape, dtype=out_dtype)
        end.replace_all_uses_with(fused)
        for gone in inside | _computing(normed, (x, weight)):  # export's asserts on what is gone keep it alive
            for check in [u for u in gone.users if u.target is aten._assert_tensor_metadata.default]:
                graph.erase_node(check)
        rewritten += 1
    if rewritten:
        graph.eliminate_dead_code()
        module.recompile()
    return rewritten


# What reads a tensor without computing on its values: layout ops, which `_read_by_attention` follows.
_LAYOUT = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.permute.default,
    aten.transpose.int,
    aten.unsqueeze.default,
}
# aten's attention ops: anything else the rotated heads may go to must be a custom op (FA3, sage).
_ATTENTION = {
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}
# An RMS norm in the graph: its input, weight (or None), eps, and whether it rounds before the weight.
Norm = tuple[torch.fx.Node, "torch.fx.Node | None", float, bool]


def _users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node`'s users but export's metadata asserts, which read nothing."""
    return [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]


def _through(node: Any, *targets: Any) -> Any:
    """The first node above `node` that is not one of `targets` (each followed through its first argument)."""
    while isinstance(node, torch.fx.Node) and node.target in targets:
        node = node.args[0]
    return node


def _to(node: Any, dtype: torch.dtype | None = None) -> Any:
    """x where `node` is `x.to(dtype)` (`aten._to_copy`; any dtype where None), or `node` itself where it
    is already of `dtype` (export writes no cast to a tensor's own dtype); else None."""
    if is_call(node, aten._to_copy.default) and set(node.kwargs) == {"dtype"}:
        return node.args[0] if dtype is None or node.kwargs["dtype"] == dtype else None
    if dtype is not None and isinstance(node, torch.fx.Node) and getattr(node.meta.get("val"), "dtype", None) == dtype:
        return node
    return None


def _back(end: Any) -> tuple[Any, Any]:
    """(y, n) where `end` is `y.type_as(n)`, (y, dtype) where it is `y.to(dtype)`, else (end, its dtype)."""
    if is_call(end, aten.type_as.default):
        return end.args[0], end.args[1]
    inner = _to(end)
    return (inner, end.kwargs["dtype"]) if inner is not None else (end, getattr(end.meta.get("val"), "dtype", None))


def _head_norm(node: Any) -> Norm | None:
    """What `node` normalizes, where it is an RMS norm over the last dim of a 4-D tensor x whose output is
    in x's dtype: torch's `aten.rms_norm` (rounded after the weight), or diffusers' `RMSNorm` as export
    writes it, `(x * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(w.dtype) * w` or, without a
    weight, `.to(x.dtype)` (rounded first), the weight a tensor; else None."""
    if is_call(node, aten.rms_norm.default):
        x, shape, weight, eps = (*node.args, None, None)[:4]
        weight, eps = node.kwargs.get("weight", weight), node.kwargs.get("eps", eps)
        found = (x, weight, torch.finfo(torch.float32).eps if eps is None else eps, False), len(shape) == 1
    else:
        weight, scaled = None, _to(node) or node
        if _plain_mul(node) and not is_call(node.args[1], aten.rsqrt.default):
            weight, scaled = node.args[1], _to(node.args[0]) or node.args[0]
        if not _plain_mul(scaled) or not is_call(scaled.args[1], aten.rsqrt.default):
            return None
        x, total = scaled.args[0], scaled.args[1].args[0]
        if not is_call(total, aten.add.Tensor) or total.kwargs or not isinstance(total.args[1], float):
            return None
        mean = total.args[0]
        ok = is_call(mean, aten.mean.dim) and list(mean.args[1]) == [-1] and mean.args[2:] == (True,)
        square = mean.args[0] if ok else None
        ok = ok and is_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2
        found = (x, weight, total.args[1], True), ok and _to(square.args[0], torch.float32) is x
    (x, weight, *_), ok = found
    nodes = isinstance(x, torch.fx.Node) and (weight is None or isinstance(weight, torch.fx.Node))
    if not (ok and nodes and x.meta["val"].dim() == 4 and node.meta["val"].dtype == x.meta["val"].dtype):
        return None
    return found[0]


def _plain_mul(node: Any) -> bool:
    """Whether `node` is `aten.mul.Tensor` of two operands and nothing else."""
    return is_call(node, aten.mul.Tensor) and len(node.args) == 2 and not node.kwargs


def _products(node: Any) -> list[tuple[Any, Any]]:
    """Both orders of `node`'s factors where it is `aten.mul.Tensor`; else none."""
    return [tuple(node.args), tuple(node.args[::-1])] if _plain_mul(node) else []


Site = tuple[tuple[torch.fx.Node, Norm], tuple[torch.fx.Node, ...], torch.fx.Node]


def _real_site(end: torch.fx.Node) -> Site | None:
    """((n, its norm), (cos, sin), end) where `end` is diffusers' real RoPE of a head norm's output n,
    `(n.float() * cos + stack([-o, e], -1).flatten().float() * sin)` rounded back to n's dtype; else None."""
    total, back = _back(end)
    if not is_call(total, aten.add.Tensor) or total.kwargs:  # alpha would scale the second term
        return None
    for plain, turned in (total.args, total.args[::-1]):
        for (a, cos), (b, sin) in ((p, q) for p in _products(plain) for q in _products(turned)):
            normed, stack = _to(a, torch.float32), _through(_to(b, torch.float32), aten.view.default)
            pairs = stacked_pairs(stack) if isinstance(stack, torch.fx.Node) else None
            norm = _head_norm(normed)
            if norm is not None and pairs is not None and _through(pairs, aten.view.default) is normed:
                if back is normed or back == normed.meta["val"].dtype:
                    return (normed, norm), (cos, sin), end
    return None


def _complex_site(end: torch.fx.Node) -> Site | None:
    """((n, its norm), (f,), end) where `end` is the complex RoPE of a head norm's output n,
    `view_as_real(view_as_complex(n.float() as pairs) * f).flatten()` rounded back to n's dtype; else None."""
    flat, back = _back(end)
    product = _through(flat, aten.view.default)
    found = complex_product(product) if isinstance(product, torch.fx.Node) else None
    if found is None:
        return None
    pairs, f = found
    normed = _to(_through(pairs, aten.view.default), torch.float32)
    norm = _head_norm(normed)
    if norm is None or not (back is normed or back == normed.meta["val"].dtype):
        return None
    return (normed, norm), (f,), end


def _same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether `a`'s value has `b`'s shape, symbolic sizes included."""
    first, second = (n.meta["val"].shape for n in (a, b))
    if len(first) != len(second):
        return False
    return all(statically_known_true(m == n) for m, n in zip(first, second, strict=True))


def _computing(node: torch.fx.Node, inputs: tuple[Any, ...], limit: int = 16) -> set[torch.fx.Node]:
    """The ops above `node` up to `inputs` (not included), at most `limit` of them."""
    found: set[torch.fx.Node] = set()
    todo = [node]
    while todo and len(found) < limit:
        node = todo.pop()
        if node in found or node in inputs or node.op != "call_function":
            continue
        found.add(node)
        todo += [a for a in node.all_input_nodes]
    return found


def _saturated_cast(end: torch.fx.Node) -> tuple[torch.dtype, torch.fx.Node]:
    """(float8_e4m3fn, the cast) where all that reads `end` is `end.clamp(-448, 448).to(float8_e4m3fn)`
    (`fa3.unit_scaled`); else (end's dtype, end)."""
    users = _users(end)
    if len(users) == 1 and is_call(users[0], aten.clamp.default) and tuple(users[0].args[1:]) == (-E4M3_MAX, E4M3_MAX):
        casts = _users(users[0])
        if len(casts) == 1 and _to(casts[0], torch.float8_e4m3fn) is users[0]:
            return torch.float8_e4m3fn, casts[0]
    return end.meta["val"].dtype, end


def _feeding(start: torch.fx.Node, end: torch.fx.Node, limit: int = 32) -> set[torch.fx.Node] | None:
    """The nodes from `start` up to `end` (not included) where everything that reads `start`, and what
    reads that, leads to `end` within `limit` nodes; else None."""
    seen: set[torch.fx.Node] = set()
    todo = [start]
    while todo:
        node = todo.pop()
        if node is end or node in seen:
            continue
        seen.add(node)
        users = _users(node)
        if not users or len(seen) > limit:
            return None
        todo += users
    return seen


def _read_by_attention(node: torch.fx.Node) -> bool:
    """Whether all that reads `node` is attention: aten's SDPA or a custom op, through layout ops."""
    for user in _users(node):
        if user.target in _LAYOUT:
            if not _read_by_attention(user):
                return False
        elif user.target not in _ATTENTION and not _is_custom_op(user.target):
            return False
    return bool(_users(node))


def _is_custom_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "prims")

"""Where an exported block computes each head's RMS norm and RoPE, and the rewrite that computes them in
norm_rope.py's kernel instead (`fuse_norm_rope`, which `lowering.decomposed` runs where the plan or
`norm_rope=on` asks)."""

from __future__ import annotations

from typing import Any, Collection

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from aot.norm_rope import E4M3_MAX, checked, norm_rope_complex, norm_rope_real
from aot.rotations import complex_product, is_call, stacked_pairs

aten = torch.ops.aten


def fuse_norm_rope(module: torch.fx.GraphModule) -> int:
    """Write each per-head RMS norm that only RoPE reads, with that rotation (and the FP8 cast after it,
    where there is one), as one `norm_rope_real` or `norm_rope_complex` call in `module`'s graph.

    A site is taken where an RMS norm (`aten.rms_norm`, or diffusers' `RMSNorm` as its ops) normalizes
    each head of a (batch, seq, heads, head_dim) tensor; all that reads its output n leads to a rotation of
    its pairs, in diffusers' real form, `n.float() * cos + stack([-o, e], -1).flatten().float() * sin`, or
    the complex form, `view_as_real(view_as_complex(n.float() as pairs) * f).flatten()` (`rotations`),
    rounded back to n's dtype; what reads the rotated tensor is attention itself (aten's SDPA or a custom
    op, through views, or through `fa3.unit_scaled`'s saturated FP8 cast, which the call then makes);
    and the kernel takes the tensors (`norm_rope.checked`). Text and image heads joined along the sequence
    count as one site, in two parts, where two such norms are joined before the rotation (FLUX's double
    block, `rope(cat([n_1, n_2], 1))`) or two rotations after (Qwen-Image's, `cat([rope_1(n_1), rope_2(n_2)],
    1)`), with the same eps and rounding: the call writes the joint heads and the `cat` is gone. Elsewhere
    Inductor's own kernel keeps what it fuses after the rotation (sage's INT8 quantization), so the site
    is left.

    Returns how many it rewrote; `module` is recompiled where any was."""
    graph = module.graph
    rewritten = 0
    sites = [site for node in graph.nodes if (site := _real_site(node) or _complex_site(node) or _joined_site(node))]
    for parts, factors, end in sites:
        out_dtype, end = _saturated_cast(end)
        insides = [_feeding(normed, end) for normed, _ in parts]
        norms = [norm for _, norm in parts]
        xs, weights = [x for x, *_ in norms], [weight for _, weight, *_ in norms]
        values = [x.meta["val"] for x in xs]
        batch, _, heads, head_dim = values[0].shape
        shape = (batch, sum(v.shape[1] for v in values), heads, head_dim)  # the parts joined along the sequence
        if None in insides or not _read_by_attention(end) or not _same_shape(end, shape):
            continue
        if len({(eps, round_first) for *_, eps, round_first in norms}) != 1:
            continue
        complex_ = len(factors[0]) == 1
        # each pair's (cos, sin), as the kernel reads them
        factor_values = [
            (torch.view_as_real(f[0].meta["val"]).flatten(-2),) if complex_ else tuple(t.meta["val"] for t in f)
            for f in factors
        ]
        try:
            checked(values, [None if w is None else w.meta["val"] for w in weights], factor_values, out_dtype)
        except ValueError:
            continue
        *_, eps, round_first = norms[0]
        with graph.inserting_before(end):
            if complex_:
                pairs = [graph.call_function(aten.view_as_real.default, f) for f in factors]
                for node, f in zip(pairs, factors, strict=True):
                    node.meta["val"] = torch.view_as_real(f[0].meta["val"])
                args = (xs, weights, eps, pairs, out_dtype, round_first)
            else:
                cos, sin = ([f[i] for f in factors] for i in (0, 1))
                args = (xs, weights, eps, cos, sin, out_dtype, round_first)
            op = norm_rope_complex if complex_ else norm_rope_real
            fused = graph.call_function(op._opoverload, args)
            fused.meta["val"] = values[0].new_empty(shape, dtype=out_dtype)
        end.replace_all_uses_with(fused)
        drop_asserts(graph, set().union(*insides, *(computing(normed, norm[:2]) for normed, norm in parts)))
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


def readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node`'s users but export's metadata asserts, which read nothing."""
    return [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]


def _through(node: Any, *targets: Any) -> Any:
    """The first node above `node` that is not one of `targets` (each followed through its first argument)."""
    while isinstance(node, torch.fx.Node) and node.target in targets:
        node = node.args[0]
    return node


def cast_from(node: Any, dtype: torch.dtype | None = None) -> Any:
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
    inner = cast_from(end)
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
        weight, rounded = None, node
        if _plain_mul(node) and not is_call(node.args[1], aten.rsqrt.default):
            weight, rounded = node.args[1], node.args[0]
        scaled = cast_from(rounded) or rounded
        if not _plain_mul(scaled) or not is_call(scaled.args[1], aten.rsqrt.default):
            return None
        x, total = scaled.args[0], scaled.args[1].args[0]
        if rounded is not scaled and cast_from(rounded, x.meta["val"].dtype) is not scaled:
            return None  # rounded to another dtype than x's, which the kernel's rounding would not repeat
        if not is_call(total, aten.add.Tensor) or total.kwargs or not isinstance(total.args[1], float):
            return None
        mean = total.args[0]
        ok = is_call(mean, aten.mean.dim) and list(mean.args[1]) == [-1] and mean.args[2:] == (True,)
        square = mean.args[0] if ok else None
        ok = ok and is_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2
        found = (x, weight, total.args[1], True), ok and cast_from(square.args[0], torch.float32) is x
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


# A site: its parts, each a head norm's output n and its norm; RoPE's factors, one tuple for the joint
# sequence or one a part, each (cos, sin) or (f,); and the node whose value the call replaces.
Part = tuple[torch.fx.Node, Norm]
Site = tuple[list[Part], list[tuple[torch.fx.Node, ...]], torch.fx.Node]


def _real_site(end: torch.fx.Node) -> Site | None:
    """The site where `end` is diffusers' real RoPE of n, a head norm's output or two joined along the
    sequence (`_head_norms`), `(n.float() * cos + stack([-o, e], -1).flatten().float() * sin)` rounded
    back to n's dtype; else None."""
    total, back = _back(end)
    if not is_call(total, aten.add.Tensor) or total.kwargs:  # alpha would scale the second term
        return None
    for plain, turned in (total.args, total.args[::-1]):
        for (a, cos), (b, sin) in ((p, q) for p in _products(plain) for q in _products(turned)):
            normed, stack = cast_from(a, torch.float32), _through(cast_from(b, torch.float32), aten.view.default)
            pairs = stacked_pairs(stack) if isinstance(stack, torch.fx.Node) else None
            parts = _head_norms(normed)
            if parts is not None and pairs is not None and _through(pairs, aten.view.default) is normed:
                if back is normed or back == normed.meta["val"].dtype:
                    return parts, [(cos, sin)], end
    return None


def _complex_site(end: torch.fx.Node) -> Site | None:
    """The site where `end` is the complex RoPE of n, a head norm's output or two joined along the
    sequence, `view_as_real(view_as_complex(n.float() as pairs) * f).flatten()` rounded back to n's dtype;
    else None."""
    flat, back = _back(end)
    product = _through(flat, aten.view.default)
    found = complex_product(product) if isinstance(product, torch.fx.Node) else None
    if found is None:
        return None
    pairs, f = found
    normed = cast_from(_through(pairs, aten.view.default), torch.float32)
    parts = _head_norms(normed)
    if parts is None or not (back is normed or back == normed.meta["val"].dtype):
        return None
    return parts, [(f,)], end


def _joined_site(end: torch.fx.Node) -> Site | None:
    """The site of two parts where `end` joins along the sequence two rotations of the same form, each of
    one head norm's output (Qwen-Image's `cat([rope_1(n_1), rope_2(n_2)], 1)`); else None."""
    if not _joins_tokens(end):
        return None
    found = [_real_site(t) or _complex_site(t) for t in end.args[0]]
    if any(site is None or len(site[0]) != 1 for site in found) or len({len(site[1][0]) for site in found}) != 1:
        return None
    return [site[0][0] for site in found], [site[1][0] for site in found], end


def _head_norms(node: Any) -> list[Part] | None:
    """[(node, its norm)] where `node` is a head norm's output (`_head_norm`), both parts where it joins
    two along the sequence; else None."""
    norm = _head_norm(node)
    if norm is not None:
        return [(node, norm)]
    if not _joins_tokens(node):
        return None
    parts = [(n, _head_norm(n)) for n in node.args[0]]
    return None if any(norm is None for _, norm in parts) else parts


def _joins_tokens(node: Any) -> bool:
    """Whether `node` is `cat` of two 4-D (batch, seq, heads, head_dim) tensors along the sequence."""
    if not is_call(node, aten.cat.default) or len(node.args[0]) != 2:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return node.meta["val"].dim() == 4 and dim % 4 == 1 and all(isinstance(t, torch.fx.Node) for t in node.args[0])


def _same_shape(node: torch.fx.Node, shape: tuple[Any, ...]) -> bool:
    """Whether `node`'s value has `shape`, symbolic sizes included."""
    found = node.meta["val"].shape
    return len(found) == len(shape) and all(statically_known_true(m == n) for m, n in zip(found, shape, strict=True))


def drop_asserts(graph: torch.fx.Graph, gone: Collection[torch.fx.Node]) -> None:
    """Erase export's metadata asserts on the nodes a rewrite left unread: they would keep them alive."""
    for node in gone:
        for check in [u for u in node.users if u.target is aten._assert_tensor_metadata.default]:
            graph.erase_node(check)


def computing(node: torch.fx.Node, inputs: Collection[Any], limit: int = 16) -> set[torch.fx.Node]:
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
    users = readers(end)
    if len(users) == 1 and is_call(users[0], aten.clamp.default) and tuple(users[0].args[1:]) == (-E4M3_MAX, E4M3_MAX):
        casts = readers(users[0])
        if len(casts) == 1 and cast_from(casts[0], torch.float8_e4m3fn) is users[0]:
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
        users = readers(node)
        if not users or len(seen) > limit:
            return None
        todo += users
    return seen


def _read_by_attention(node: torch.fx.Node) -> bool:
    """Whether all that reads `node` is attention: aten's SDPA or a custom op, through layout ops."""
    for user in readers(node):
        if user.target in _LAYOUT:
            if not _read_by_attention(user):
                return False
        elif user.target not in _ATTENTION and not _is_custom_op(user.target):
            return False
    return bool(readers(node))


def _is_custom_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "prims")

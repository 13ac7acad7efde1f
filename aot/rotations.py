"""RoPE's rotation of pairs, rewritten in an exported graph so that Inductor reads each pair's other
entry with one load: `flip_pair_rotations`, which `lowering.decomposed` runs on every program.

diffusers writes the rotation two ways, and Inductor lowers neither well:
* real, `stack([-x[..., 1], x[..., 0]], -1)` of `x.unbind(-1)` (`apply_rotary_emb`: FLUX.1, FLUX.2,
  Chroma). Inductor writes the stack as a select between two loads masked by parity, each with its own
  copy of what makes x (a q or k norm).
* complex, `view_as_real(view_as_complex(x) * f)` with f complex (Qwen-Image's `apply_rotary_emb_qwen`,
  Z-Image's attention). Inductor has no complex arithmetic: the package writes x in float32, calls
  ATen's complex multiply on it, and reads its float32 product back, three passes over each q and k.

The real form's rotated pairs become `flip(x, [-1]) * [-1, 1]`, and the complex product
`x * re(f) + flip(x, [-1]) * [-1, 1] * im(f)`: one load of each pair's other entry, inside the kernel
that makes x.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

aten = torch.ops.aten


def is_pair_rotation(node: torch.fx.Node) -> bool:
    """Whether `node` ends a rotation of pairs that `flip_pair_rotations` rewrites."""
    return stacked_pairs(node) is not None or complex_product(node) is not None


def flip_pair_rotations(module: torch.fx.GraphModule) -> int:
    """Rewrite each rotation of pairs in `module`'s graph (module docstring) as a flip of the pairs:
    x (..., n, 2), `stack([-x[..., 1], x[..., 0]], -1)` as `flip(x, [-1]) * [-1, 1]`, the same values to
    the bit (a product by +-1 is exact); `view_as_real(view_as_complex(x) * f)` as
    `x * re(f) + flip(x, [-1]) * [-1, 1] * im(f)`, the complex product's own two products and sum,
    in x's float dtype. A compiled kernel may still round what follows differently where Triton fuses
    a multiply and an add into one.

    Measured on an H100, each against its own run's eager row (2026-12-07, BENCHMARKS.md "Pair rotations
    flipped"): the real form, FLUX.1-dev's step 82.5 against 83.9 ms (its double block's q and k norms,
    RoPE and FP8 casts 1.45 against 2.80 ms a step); the complex form over the real form alone,
    Z-Image's step 63.6 against 65.7 ms and Qwen-Image's 89.5 against 90.1 ms (ATen's complex multiply,
    3.05 and 4.59 ms a step, gone).

    Returns how many it rewrote; `module` is recompiled where any was."""
    graph = module.graph
    call = graph.call_function
    rewritten = 0
    for node in list(graph.nodes):
        stacked, product = stacked_pairs(node), complex_product(node)
        if stacked is None and product is None:
            continue
        pairs = stacked if stacked is not None else product[0]
        val = pairs.meta["val"]
        with graph.inserting_before(node):
            signs = call(aten.arange.start_step, (-1, 2, 2), {"dtype": val.dtype, "device": val.device})  # [-1, 1]
            rotated = call(aten.mul.Tensor, (call(aten.flip.default, (pairs, [-1])), signs))
            if product is not None:  # (c + i s)(x0 + i x1) = (x0 c - x1 s) + i (x1 c + x0 s)
                parts = call(aten.view_as_real.default, (product[1],))
                cos, sin = (call(aten.slice.Tensor, (parts, -1, i, i + 1)) for i in (0, 1))
                scaled = call(aten.mul.Tensor, (pairs, cos))
                rotated = call(aten.add.Tensor, (scaled, call(aten.mul.Tensor, (rotated, sin))))
            node.replace_all_uses_with(rotated)
        rewritten += 1
    if rewritten:
        graph.eliminate_dead_code()
        module.recompile()
    return rewritten


def is_call(node: Any, target: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.target is target


def _last_dim_of_pairs(node: torch.fx.Node, dim: int) -> bool:
    """`node` is a real tensor (..., 2) and `dim` names its last dim."""
    val = node.meta.get("val")
    if val is None or val.is_complex() or val.dim() < 1 or val.shape[-1] != 2:
        return False
    return dim % val.dim() == val.dim() - 1


def stacked_pairs(node: torch.fx.Node) -> torch.fx.Node | None:
    """x where `node` is `stack([-x[..., 1], x[..., 0]], -1)` of `x.unbind(-1)`, x (..., 2); else None."""
    if not is_call(node, aten.stack.default) or len(node.args[0]) != 2:
        return None
    (neg, real), dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not is_call(neg, aten.neg.default):
        return None
    imag = neg.args[0]
    if not (is_call(real, operator.getitem) and is_call(imag, operator.getitem)):
        return None
    unbind = real.args[0]
    if imag.args[0] is not unbind or not is_call(unbind, aten.unbind.int) or (real.args[1], imag.args[1]) != (0, 1):
        return None
    pairs = unbind.args[0]
    unbind_dim = unbind.args[1] if len(unbind.args) > 1 else unbind.kwargs.get("dim", 0)
    if not _last_dim_of_pairs(pairs, unbind_dim) or not _last_dim_of_pairs(pairs, dim):
        return None
    return pairs


def complex_product(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(x, f) where `node` is `view_as_real(view_as_complex(x) * f)` (either order), x a real float
    tensor (..., 2) and f complex; else None."""
    if not is_call(node, aten.view_as_real.default) or not is_call(node.args[0], aten.mul.Tensor):
        return None
    factors = node.args[0].args
    for complex_x, f in (factors, factors[::-1]):
        if not (is_call(complex_x, aten.view_as_complex.default) and isinstance(f, torch.fx.Node)):
            continue
        pairs, f_val = complex_x.args[0], f.meta.get("val")
        if f_val is not None and f_val.is_complex() and _last_dim_of_pairs(pairs, -1):
            return pairs, f
    return None

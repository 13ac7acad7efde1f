"""Where an exported block quantizes a GEMM's input rows to FP8 from a `cat` or a GELU, and the rewrite that
makes those rows in row_fp8.py's kernel instead (`fuse_row_fp8`, which `lowering.decomposed` runs where
`row_fp8=on` asks)."""

from __future__ import annotations

import operator
from typing import Any

import torch

from aot.gelu import GELU_CUBE, SQRT_2_OVER_PI
from aot.norm_rope_sites import cast_from, computing, drop_asserts, readers
from aot.rotations import is_call
from aot.row_fp8 import E4M3_MAX, FLOOR, problem, row_quantize

aten = torch.ops.aten
# A part of a row as the kernel reads it: x, its row scale, column scale and bias (or None), and whether a
# GELU follows.
Part = tuple[torch.fx.Node, Any, Any, Any, bool]


def fuse_row_fp8(module: torch.fx.GraphModule) -> int:
    """Write each row-wise FP8 quantization of a `cat` of two parts or of a GELU's output as one
    `row_fp8.row_quantize` call in `module`'s graph.

    A site is torchao's quantization of an activation x (`Float8Tensor`'s: `torchao.choose_scale_float8(x,
    [1, ..., k])`, s, and `(x.float() / d).clamp(-448, 448).to(float8_e4m3fn)` with d = s, or s clamped at
    float32's smallest normal as `fp8.RowScalesAfterGEMM` divides), where x is read by nothing else and is
    `cat([x_1, x_2], -1)` or one part; each part is y or `gelu(y)` (`gelu.gelu_tanh_approx`'s ops)
    with y an input or `(p * (r * c) + b).to(bf16)` (`RowScalesAfterGEMM`'s scales and bias after its
    GEMM); at least one part has a GELU, or there are two; and the kernel takes the tensors
    (`row_fp8.problem`). FLUX's single block's `proj_out` input is such a row, `cat([attention, gelu(mlp)],
    -1)`, and its double block's MLP output's. The call gives the FP8 rows and the scales; what read s
    reads the call's scales, and the clamp where there is one stays.

    Returns how many it rewrote; `module` is recompiled where any was."""
    graph = module.graph
    rewritten = 0
    for scale in [n for n in graph.nodes if _is_choose_scale(n)]:
        site = _site(scale)
        if site is None:
            continue
        x, parts, floor, data, inside = site
        if len(parts) == 1 and not parts[0][4]:
            continue  # one part and no GELU: Inductor's own kernel makes it as well
        values = [[None if t is None else t.meta["val"] for t in part[:4]] for part in parts]
        if problem(*([v[i] for v in values] for i in range(4)), [part[4] for part in parts]):
            continue
        with graph.inserting_before(scale):
            args = (*([part[i] for part in parts] for i in range(5)), floor)
            call = graph.call_function(row_quantize._opoverload, args)
            call.meta["val"] = (data.meta["val"], scale.meta["val"])
            fp8, scales = (graph.call_function(operator.getitem, (call, i)) for i in (0, 1))
            fp8.meta["val"], scales.meta["val"] = call.meta["val"]
        data.replace_all_uses_with(fp8)
        scale.replace_all_uses_with(scales)
        inputs = {t for part in parts for t in part[:4] if t is not None}
        drop_asserts(graph, inside | {scale, data} | computing(x, inputs, limit=64))
        rewritten += 1
    if rewritten:
        graph.eliminate_dead_code()
        module.recompile()
    return rewritten


def _site(scale: torch.fx.Node) -> tuple[Any, list[Part], bool, torch.fx.Node, set[torch.fx.Node]] | None:
    """(x, its parts, whether the division floors the scale, the FP8 cast, the nodes between x and the cast)
    where `scale` is torchao's row-wise scale of x and x's FP8 rows are cast as torchao casts them; else None."""
    given = _arguments(scale)
    x, block = given["tensor"], given["block_size"]
    value = x.meta["val"]
    row_wise = list(block) == [1] * (value.dim() - 1) + [value.shape[-1]]
    dtypes = (given.get("float8_dtype", torch.float8_e4m3fn), given.get("scale_dtype", torch.float32))
    if not row_wise or dtypes != (torch.float8_e4m3fn, torch.float32):  # torchao's defaults
        return None
    if given.get("hp_value_lb") is not None or given.get("hp_value_ub") is not None:
        return None  # bounds on the abs-max, which the kernel does not apply
    wide = [u for u in readers(x) if u is not scale]
    if len(wide) != 1 or cast_from(wide[0], torch.float32) is not x or len(readers(wide[0])) != 1:
        return None
    divided = readers(wide[0])[0]
    if not is_call(divided, aten.div.Tensor) or divided.args[0] is not wide[0]:
        return None
    floored = is_call(divided.args[1], aten.clamp.default) and tuple(divided.args[1].args[1:]) == (FLOOR,)
    if (divided.args[1].args[0] if floored else divided.args[1]) is not scale:
        return None
    clamped = readers(divided)
    if len(clamped) != 1 or not is_call(clamped[0], aten.clamp.default):
        return None
    if tuple(clamped[0].args[1:]) != (-E4M3_MAX, E4M3_MAX) or len(readers(clamped[0])) != 1:
        return None
    data = readers(clamped[0])[0]
    if cast_from(data, torch.float8_e4m3fn) is not clamped[0] or data.meta["val"].dtype != torch.float8_e4m3fn:
        return None
    last = value.dim() - 1
    joined = is_call(x, aten.cat.default) and len(x.args[0]) == 2 and (x.args[1:] or (0,))[0] in (-1, last)
    parts = [_part(p) for p in x.args[0]] if joined else [_part(x)]
    return x, parts, floored, data, {wide[0], divided, clamped[0]}


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The arguments `node` was given, by name (export records them by position); those left out are
    its schema's defaults."""
    names = [a.name for a in node.target._schema.arguments]
    return {**dict(zip(names, node.args, strict=False)), **node.kwargs}


def _plain_add(node: Any) -> bool:
    """Whether `node` is `a + b` (`aten.add.Tensor`, its `alpha` left at 1)."""
    return is_call(node, aten.add.Tensor) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1


def _part(node: torch.fx.Node) -> Part:
    """`node` as the kernel reads it: (y, r, c, b, gelu) where node is `gelu(y)` or y (through copies: the
    `clone` an eval-mode dropout exports as), and y is `(p * (r * c) + b).to(bf16)` (then (p, r, c, b, gelu))
    or anything else (then (y, None, None, None, gelu))."""
    while is_call(node, aten.clone.default) and not node.kwargs:
        node = node.args[0]
    inner = _gelu_of(node)
    y = node if inner is None else inner
    scaled = _scaled(y)
    return (*scaled, inner is not None) if scaled else (y, None, None, None, inner is not None)


def _is_choose_scale(node: torch.fx.Node) -> bool:
    """Whether `node` calls `torchao.choose_scale_float8` (named, not looked up: torchao registers it when
    imported, which a graph without FP8 layers does not need)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.name() == "torchao::choose_scale_float8"


def _gelu_of(node: Any) -> Any:
    """y where `node` is `gelu.gelu_tanh_approx(y)` in bf16 as the decomposition writes it:
    `(f * 0.5 * (tanh_approx((f + f * 0.044715 * f * f) * sqrt(2/pi)) + 1)).to(bf16)`, f = `y.float()`,
    each product in that order, the last product read by the cast alone; else None."""
    product = cast_from(node, torch.bfloat16) if is_call(node, aten._to_copy.default) else None
    if not is_call(product, aten.mul.Tensor) or len(readers(product)) != 1:
        return None
    half, shifted = product.args
    if not (is_call(half, aten.mul.Tensor) and half.args[1] == 0.5 and _plain_add(shifted)):
        return None
    f = half.args[0]
    y = cast_from(f, torch.float32) if is_call(f, aten._to_copy.default) else None
    tanh = shifted.args[0]
    if y is None or shifted.args[1] != 1 or not is_call(tanh, torch.ops.aot_lowering.tanh_approx.default):
        return None
    z = tanh.args[0]
    if not is_call(z, aten.mul.Tensor) or z.args[1] != SQRT_2_OVER_PI or not _plain_add(z.args[0]):
        return None
    plus, cube = z.args[0].args
    if plus is not f or not _cubed(cube, f) or y.meta["val"].dtype != torch.bfloat16:
        return None
    return y


def _cubed(node: Any, f: torch.fx.Node) -> bool:
    """Whether `node` is `f * 0.044715 * f * f`, multiplied left to right."""
    for _ in range(2):
        if not is_call(node, aten.mul.Tensor) or node.args[1] is not f:
            return False
        node = node.args[0]
    return is_call(node, aten.mul.Tensor) and node.args[0] is f and node.args[1] == GELU_CUBE


def _scaled(node: Any) -> tuple[Any, Any, Any, Any] | None:
    """(p, r, c, b) where `node` is `(p * (r * c) + b).to(bf16)` or, without a bias, `(p * (r * c)).to(bf16)`,
    in float32 as `fp8.RowScalesAfterGEMM` writes it, r the rows' scales (float32) and c the columns'
    (bf16); else None."""
    inner = cast_from(node, torch.bfloat16) if is_call(node, aten._to_copy.default) else None
    bias = None
    if _plain_add(inner):
        inner, bias = inner.args
    if not is_call(inner, aten.mul.Tensor) or not is_call(inner.args[1], aten.mul.Tensor):
        return None
    product, (rows, columns) = inner.args[0], inner.args[1].args
    found = (product, rows, columns, bias or product)
    if not all(isinstance(t, torch.fx.Node) and isinstance(t.meta.get("val"), torch.Tensor) for t in found):
        return None  # e.g. a SymInt added or multiplied in
    return product, rows, columns, bias

"""One FP8 input for the GEMMs that read the same rows: `merge_common_subexpressions` on the exported
graph, `shared_exact_inputs` while Inductor lowers it. `lowering.compile_package` applies both.

torchao quantizes a linear layer's input inside that layer, so rows read by several layers are
quantized once per layer: FLUX's single block quantizes its norm's output four times (to_q, to_k,
to_v, proj_mlp), its double block three times a stream. Inductor fuses the four into one kernel, which
then stores four copies of the same FP8 rows and row scales (4 x 14 MB at 1024x1024, H100 kernel
sources, 2026-12-07).

Merging the four in the graph is not enough. `aten._scaled_mm` carries the `needs_exact_strides` tag,
so Inductor constrains each GEMM's input to the strides export recorded
(`torch._inductor.lowering.constrain_to_fake_tensor`); where that input is a reshape of a pointwise result not yet
stored, `ExternKernel.require_strides` copies it (`copy_input`) for each GEMM that reads it, and the
copies fuse back into four stores. `GraphLowering.run_node` stores such a shared input once only for
the ops it lists as needing a fixed layout (mm, _int_mm, convolutions), not `_scaled_mm`.

With both, the kernel stores the FP8 rows and scales once (tests/test_lowering.py, on the kernel a CPU compile
writes). By bytes that is about 2.2 GB fewer writes a FLUX.1-dev step at 1024x1024; its GPU time is not measured
yet (BENCHMARKS.md "One FP8 input for the GEMMs that read the same rows").
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from aot.thread_flags import ThreadFlag


def has_common_subexpressions(graph: torch.fx.Graph) -> bool:
    """Whether `merge_common_subexpressions` would merge any of `graph`'s nodes. `graph` is left as it
    was but for the `mutation_region_id` that `fx_graph_cse` writes into each node's meta."""
    from torch._functorch.compile_utils import fx_graph_cse

    return len(fx_graph_cse(graph).nodes) < len(graph.nodes)


def merge_common_subexpressions(module: torch.fx.GraphModule) -> int:
    """Merge the nodes of `module`'s graph that compute the same op of the same inputs
    (functorch's `fx_graph_cse`, which AOTAutograd runs on training graphs: random ops, mutated
    inputs and distinct outputs stay apart), in place. Returns how many nodes it removed; `module`
    is recompiled where any were. Placeholders and outputs keep their names, which an exported
    program's signature refers to."""
    from torch._functorch.compile_utils import fx_graph_cse

    before = len(module.graph.nodes)
    merged = fx_graph_cse(module.graph)
    removed = before - len(merged.nodes)
    if removed:
        module.graph = merged
        module.recompile()
    return removed


@contextlib.contextmanager
def shared_exact_inputs() -> Iterator[None]:
    """While inside, on this thread, Inductor stores once a reshape of a result not yet stored that ops
    tagged `needs_exact_strides` read (`_scaled_mm`'s FP8 input), where it would copy it for each reader
    (module docstring). Only a reshape of all of that result, read contiguous: a stored buffer gives
    that as a view, holding what the copy would have held (any other view would be copied anyway).
    Elsewhere Inductor's own constraint runs. Nests; an error leaves it as entered."""
    _teach_shared_exact_inputs()
    with _SHARED.entered():
        yield


_SHARED = ThreadFlag()  # on: this thread is inside `shared_exact_inputs`


@functools.cache
def _teach_shared_exact_inputs() -> None:
    """Wrap `lowering.constrain_to_fake_tensor` (which `constrain_to_fake_tensors`, the
    `needs_exact_strides` constraint, calls per argument) to store such reshapes first inside
    `shared_exact_inputs`. Once a process."""
    from torch._inductor import lowering

    own = lowering.constrain_to_fake_tensor

    def constrain(arg: Any, fake_arg: Any) -> Any:
        if _SHARED.on and isinstance(fake_arg, torch.Tensor) and fake_arg.is_contiguous():
            _store_reshaped_buffer(arg)
        return own(arg, fake_arg)

    lowering.constrain_to_fake_tensor = constrain


def _store_reshaped_buffer(arg: Any) -> None:
    """Store the result under `arg` where `arg` is a reshape (`ir.View`) of all of a result not yet
    stored."""
    from torch._inductor import ir

    if not (isinstance(arg, ir.TensorBox) and isinstance(arg.data, ir.View)):
        return
    box = arg.data.data
    if not isinstance(box, ir.StorageBox) or box.is_input_buffer() or isinstance(box.data, ir.Buffer):
        return
    if box.get_numel() == arg.data.get_numel():
        box.realize()

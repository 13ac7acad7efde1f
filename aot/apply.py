"""`apply_`: compiled packages put to work on a pipeline, in the process that serves it.

What the startup's GPU call returns (compile.py's `compile_transformer`: packages and decisions)
is applied here, in the main process, with no GPU work: on ZeroGPU that is the process whose
weights are emulated CUDA tensors, and the workers forked from it inherit every patch. Packages
are loaded at each block class's first call, inside the request's worker.
"""

from __future__ import annotations

import logging
from typing import Any

from aot import lora, text_fp8
from aot.blocks import patch_forward, patched_forward, repeated_blocks, unpatch_forward
from aot.compiled import Compiled, Report
from aot.fp8 import quantize_block_
from aot.graphs import GraphedStep, graph_step_
from aot.runner import BindingCheck, CompiledBlock, SharedPackage, check_constants

log = logging.getLogger("compile")


def apply_(pipe: Any, compiled: Compiled) -> Report:
    """Make `pipe` run `compiled`, in place; returns the report (`print` it).

    Every repeated block of `pipe.transformer` runs its class's package bound to its own weights
    (FP8-quantized first where the package is: `patch_blocks_`); the text encoders' layers
    the FP8 trial kept are quantized (`text_fp8.apply_`); peft's adapter calls raise from now on
    (`lora.forbid_peft_`: an adapter added later would be ignored); and where the GPU call decided
    so, the transformer's step runs as CUDA graphs (`graphs.graph_step_`). Applying again (another
    set of packages) replaces the previous one.

    Raises:
        ValueError: a block does not match its package (other weights, shapes or dtypes), or the
            transformer has accelerate offload hooks.
        ImportError, OSError, RuntimeError: the FA3 kernel the packages call cannot be loaded.
    """
    unpatch_forward(pipe.transformer, GraphedStep)  # its graphs replay the blocks being replaced
    report = patch_blocks_(pipe, compiled)
    if compiled.text_fp8 is not None:  # the trial ran in the GPU call; here its FP8 layers are quantized too
        text_fp8.apply_(pipe, compiled.text_fp8)
        report.decisions = [*report.decisions, compiled.text_fp8.decision]
    lora.forbid_peft_(pipe)
    if compiled.graphs is not None:
        if compiled.graphs.value == "on":
            graph_step_(pipe.transformer, strict=compiled.graphs.asked == "on")
        report.decisions = [*report.decisions, compiled.graphs]
    return report


def patch_blocks_(pipe: Any, compiled: Compiled) -> Report:
    """Patch every repeated block of `pipe.transformer` to run its class's package, in place.

    Each block keeps its parameters (the package binds to them: one copy of the weights). Nothing
    here runs on the GPU or loads a package (FP8 quantizes the weights where they are: emulated CUDA
    tensors in a ZeroGPU main process), so it runs in the main process everywhere. The FA3 kernel
    the packages call is imported here (`SharedPackage`; no GPU work), so ZeroGPU workers inherit it
    through fork instead of each importing it at its first step.

    Raises:
        ValueError: a block does not match its package, or the patched count is off.
        ImportError, OSError, RuntimeError: the FA3 kernel the packages call cannot be loaded (`load_fa3`).
    """
    if any(hasattr(m, "_hf_hook") for m in pipe.transformer.modules()):
        raise ValueError(
            "the transformer has accelerate offload hooks (enable_model_cpu_offload / "
            "enable_sequential_cpu_offload): they move weights between calls, while compiled blocks bind "
            "to the weights' memory once. Keep the pipeline on the GPU (pipe.to('cuda')) to compile it."
        )
    blocks = repeated_blocks(pipe.transformer)
    rows = []
    for name, found in blocks.items():
        package = compiled.packages[name]
        if package.fp8:
            for block in found:
                quantize_block_(block, package.fp8)
        for index, block in enumerate(found):
            check_constants(block, package, index)
        shared = SharedPackage(package, compiled.fa3_kernel)  # one load per class, not per block
        for block in found:
            patch_forward(block, CompiledBlock(block, shared))
        rows.append((package, len(found)))
    patches = [p for m in pipe.transformer.modules() if (p := patched_forward(m, CompiledBlock)) is not None]
    if hasattr(pipe.transformer, "_binding_check"):  # applied before: check the blocks patched now
        pipe.transformer._binding_check.remove()
    pipe.transformer._binding_check = pipe.transformer.register_forward_pre_hook(BindingCheck(patches))
    patched = len(patches)
    if patched != sum(count for _, count in rows):
        raise ValueError(f"patched {patched} blocks, expected {sum(count for _, count in rows)}")
    return Report(rows, compiled.decisions, compiled.resolution, compiled.source, compiled)

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
from aot.blocks import Compiled, Report, patch_blocks_, unpatch_forward
from aot.graphs import GraphedStep, graph_step_

log = logging.getLogger("compile")


def apply_(pipe: Any, compiled: Compiled) -> Report:
    """Make `pipe` run `compiled`, in place; returns the report (`print` it).

    Every repeated block of `pipe.transformer` runs its class's package bound to its own weights
    (FP8-quantized first where the package is: `blocks.patch_blocks_`); the text encoders' layers
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

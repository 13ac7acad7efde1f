"""`optimize_`: the startup's one GPU call (load saved packages or compile), then apply, graph, save.

Loading saved packages or compiling runs in one `@spaces.GPU(duration=1500)` call, which on a
ZeroGPU Space is a GPU worker: the pipeline reaches it through fork (module state), the attention
and FP8 decisions are made on the real card there, and only the small packages cross back.
`apply_` runs in the main process and touches no GPU; packages are loaded at each block's first
call, inside the request's worker. zerogpu.py has the whole map of what runs where.
"""

from __future__ import annotations

import logging
from typing import Any

from aot import lora, native, text_fp8, zerogpu
from aot.blocks import (
    Compiled,
    Report,
    apply_,
    unpatch_forward,
)
from aot.export import LONG_PROMPT, compile_blocks
from aot.fast_paths import Trials, resolve_cuda_graphs
from aot.graphs import GraphedStep, graph_step_
from aot.options import Options
from aot.packages import check_push_target, check_save_target, load_packages, push_packages, save_packages
from aot.target import Target

log = logging.getLogger("compile")


def optimize_(
    pipe: Any, options: Options | None = None, compiled: Compiled | None = None, target: Target | None = None
) -> Report:
    """Regionally AoT-compile `pipe.transformer` in place, or bind saved packages that match.

    With `options.cuda_graphs` (`auto`: on CUDA) the step then runs as CUDA graphs (graphs.py).
    With `options.load`, verified packages from that folder or Hub repo are used; when they do not
    match, the reason is logged and the blocks are compiled (or, with `options.strict`, it raises).
    With `options.save` (and `options.push`) the packages in use, compiled or loaded, are saved
    (and published). Loading or compiling is one GPU call (`_load_or_compile`); the rest runs here.
    With `compiled` (another replica's packages, for the same GPU model) those are bound instead.
    `target`: the pipeline's (`replicas.start` works it out once), handed to the load path and the
    compile path alike; worked out here when not given.

    Raises:
        RuntimeError: strict loading failed; before any compile: a save or push target that cannot
            be written (a Hub repo without a token), or an explicitly requested fast path that cannot run.
        ValueError: see `compile_blocks` and `apply_`.
    """
    global _pipeline, _target
    options = options or Options()
    if options.save:
        check_save_target(options.save)  # before minutes of compiling, not after
    if options.push:
        check_push_target(options.push)
    graphs = resolve_cuda_graphs(options, pipe.transformer.device)
    unpatch_forward(pipe.transformer, GraphedStep)  # its graphs replay the blocks being replaced
    if compiled is None:
        native.wait_for_probe()  # no thread may be mid-work when the GPU call forks (ZeroGPU)
        _pipeline, _target = pipe, target or Target.of(pipe, options)
        try:
            compiled = zerogpu.gpu(_load_or_compile, duration=zerogpu.STARTUP_SECONDS, size=options.gpu_size)(options)
        finally:
            _pipeline, _target = None, None
    report = apply_(pipe, compiled)
    if compiled.text_fp8 is not None:  # the trial ran in the GPU call; here its FP8 layers are quantized too
        text_fp8.apply_(pipe, compiled.text_fp8)
        report.decisions = [*report.decisions, compiled.text_fp8.decision]
    lora.forbid_peft_(pipe)  # an adapter added from now on would be ignored: raise instead
    if graphs.value == "on":
        graph_step_(pipe.transformer, strict=options.cuda_graphs == "on")
    report.decisions = [*report.decisions, graphs]
    if options.save:
        save_packages(compiled, options.save)
        if options.push:
            log.info("pushed packages to %s", push_packages(options.save, options.push, options.model))
    return report


# The pipeline `_load_or_compile` works on, and its target. On ZeroGPU they reach the GPU worker
# through fork, as module state: arguments are pickled, and a pipeline's emulated CUDA tensors cannot be.
_pipeline: Any = None
_target: Target | None = None


def _load_or_compile(options: Options) -> Compiled:
    """(On the GPU.) Verified packages from `options.load`, else `compile_blocks(_pipeline)`; with
    the text encoders' FP8 trial (`text_fp8.trial_`, first: it holds an encoder's bf16 weights
    beside their FP8 copy) in `Compiled.text_fp8`. The GPU's trials (`fast_paths.Trials`) are worked
    out once, here on the real card, and both paths get them with `_target`: the load path looks
    for the variants the compile path would make.

    Raises:
        RuntimeError: `options.strict` and the saved packages cannot be used; see `compile_blocks`
            and `text_fp8.trial_`.
    """
    text = text_fp8.trial_(_pipeline, LONG_PROMPT, options.text_fp8)
    log.info("%s", text)
    compiled, trials = None, Trials.resolve(options, _pipeline.transformer)
    if options.load:
        compiled, reason = load_packages(options.load, _pipeline, options, _target, trials)
        if compiled is None and options.strict:
            raise RuntimeError(f"packages from {options.load} cannot be used: {reason}")
        if compiled is None:
            log.warning("packages from %s not used: %s; compiling", options.load, reason)
    compiled = compiled or compile_blocks(_pipeline, options, _target, trials)
    compiled.text_fp8 = text
    return compiled

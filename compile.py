"""Regional ahead-of-time compilation of a pipeline's transformer: the startup's one GPU call.

    capture  each repeated block class's real inputs, recorded from real pipeline calls
    export   `torch.export` of one block per class, the image-token dimension dynamic (and the
             text-token one where the text length follows the prompt)
    compile  AOTInductor: one weights-less package per class (a few MB, no parameters inside)
    apply    (app.py, `aot.apply_`) every block of the class runs that package on its own weights

`compile_transformer(pipe, options)` is what app.py calls at startup. Its GPU work is one
`@spaces.GPU(duration=1500)` call: on a ZeroGPU Space a worker forked from the main process, on
the real card, where the trials run; the pipeline reaches it through the closure (fork), never as
an argument, and only the packages and the decisions cross back. Outside ZeroGPU it is a plain call.

Every `auto` fast path is a trial (export, compile, load, parity against eager) in the order the
GPU's plan gives (`plans.PLANS`, keyed by compute capability): on Hopper FP8 attention -> FA3 -> SDPA,
elsewhere sage (8-bit attention in Triton, where it beats SDPA) -> SDPA; FP8 per row (on sm_120 and
sm_89 with the row scales applied after the GEMM, which cuBLAS cannot scale per row there) -> per tensor ->
bf16; each fallback with its reason in the report; only the plain bf16 SDPA block
has no fallback. torch's AOTI API is used directly (`torch.export.export`,
`torch._inductor.aoti_compile_and_package`, the package loader, `load_constants`) rather than the
`spaces.aoti_*` helpers that wrap the same steps: packages are verified before they load, every
call's inputs are checked, and CPU-only torch builds run them too.

    python compile.py --model assets/tiny-flux                      # compile, check, print the report
    python compile.py --model assets/tiny-flux --save packages      # ... and save the packages
    python compile.py --model assets/tiny-flux --load packages      # bind saved packages (compile if stale)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from typing import Any

import spaces

from aot import (
    Compiled,
    Options,
    Target,
    Trials,
    apply_,
    compile_blocks,
    load_pipeline,
    load_saved,
    save_and_push,
    text_fp8,
    zerogpu,
)
from aot.destinations import check_push_target, check_save_target
from aot.export import LONG_PROMPT
from aot.options import usage_errors

log = logging.getLogger("compile")


def compile_transformer(pipe: Any, options: Options, gpu_size: str | None = None) -> Compiled:
    """Compile `pipe.transformer`'s repeated blocks ahead of time, or load saved packages that match.

    In one `@spaces.GPU(duration=1500)` call (a ZeroGPU worker, on the card that will serve): the
    GPU's plan of trials resolved once (attention, FP8, CUDA graphs, cuBLASLt's workspace:
    `plans.Trials`), the text encoders' FP8 trial (`AOT_TEXT_FP8`), then the verified packages of `options.load`, or
    capture + export + compile (`export.compile_blocks`). Nothing is applied or saved here:
    `aot.apply_(pipe, compiled)`, `aot.save_and_push(compiled, options)`.

    Args:
        pipe: a loaded diffusers pipeline (`aot.load_pipeline`) whose family has a row in families.py.
        options: every setting (`aot.Options`).
        gpu_size: the ZeroGPU card size to compile on (app.py's `GPU_SIZE`: None is spaces' default).

    Returns:
        The packages (bytes, one per block class) and every decision with its reason; picklable.

    Raises:
        RuntimeError: before the GPU call: `options.save` or `options.push` cannot be written;
            in it: an explicitly requested fast path cannot run, `options.strict` and the saved
            packages cannot be used, or a compiled bf16 block differs from eager.
        ValueError: no repeated blocks, or block inputs the shape rule cannot describe.
    """
    target = Target.of(pipe, options)
    if options.save:  # a save or push that cannot work is refused now, not after minutes of compiling
        check_save_target(options.save)
    if options.push:
        check_push_target(options.push)

    @spaces.GPU(duration=1500, size=gpu_size)
    @zerogpu.worker  # the worker's exceptions, and what it checked, come back whole
    def compile_on_gpu() -> Compiled:
        trials = Trials.resolve(options, pipe.transformer)  # first, before any GEMM: the plan sets cuBLASLt's workspace
        text = text_fp8.trial_(pipe, LONG_PROMPT, options.text_fp8)  # then: it holds bf16 beside FP8 for a moment
        compiled = load_saved(options, pipe, target, trials) if options.load else None
        compiled = compiled or compile_blocks(pipe, target, trials)
        return dataclasses.replace(compiled, text_fp8=text, graphs=trials.graphs)

    return compile_on_gpu()


def main(argv: list[str] | None = None) -> int:
    """`python compile.py`: compile (or load) on one device, check, print the report. The defaults
    are app.py's (`MODEL_ID`, the side range); a setting that cannot work stops it with one line."""
    import app  # here, not above: app.py imports this module

    parser = argparse.ArgumentParser(
        prog="compile.py",
        description=__doc__,
        parents=[Options.parser(app.OPTION_DEFAULTS)],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    args = parser.parse_args(argv)
    with usage_errors(parser):
        options = Options.from_env(args, defaults=app.OPTION_DEFAULTS)
        if not options.compile:
            parser.error("--no-compile: compile.py compiles; `python app.py --no-compile` serves the eager pipeline")
        if options.devices != "auto":
            given = f"--devices {args.devices}" if args.devices is not None else f"AOT_DEVICES={options.devices}"
            parser.error(
                f"{given}: compile.py compiles on one device (--device, e.g. --device cuda:1); "
                "--devices is for app.py (one replica per device)"
            )
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        pipe = load_pipeline(options)
        start = time.perf_counter()
        compiled = compile_transformer(pipe, options)
        report = apply_(pipe, compiled)
        ready = time.perf_counter() - start
        if options.save:
            print(f"saved to {save_and_push(compiled, options)}")
    side = options.min_side
    first = time.perf_counter()
    call = Target.of(pipe, options).family.capture_call(pipe, "a test", side, side)
    pipe(**call, output_type="latent")  # loads and binds every block
    print(report)
    took = time.perf_counter() - first
    print(f"packages {report.source} in {ready:.1f} s; the first step at {side}x{side} took {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regional ahead-of-time (AoT) compilation of a diffusion transformer, as the recipe's verbs.

    capture  record each repeated block class's real inputs from real pipeline calls (families.py
             says how a call of this pipeline class looks)
    export   torch.export one block per class, container and weight layout, with the image-token
             dimension dynamic (and the text-token one where the text length follows the prompt)
    compile  AOTInductor: one weights-less package per class (a few MB, no parameters inside)
    apply    every block of the class runs that one package, bound to the block's own weights
    graph    optional (`cuda_graphs`): each image size's step is captured once, then replayed (graphs.py)
    save / load   packages on disk or the Hub, verified by a fingerprint (packages.py)

`optimize_(pipe)` does all of it in place and returns a `Report`. Loading saved packages or the
first three steps (`compile_blocks`) run in one `@spaces.GPU(duration=1500)` call, which on a
ZeroGPU Space is a GPU worker: the pipeline reaches it through fork (module state), the attention
and FP8 decisions are made on the real card there, and only the small packages cross back.
`apply_` runs in the main process and touches no GPU; packages are loaded at each block's first
call, inside the request's worker. zerogpu.py has the whole map of what runs where. Outside ZeroGPU
`@spaces.GPU` changes nothing and everything runs in this process.

Every `auto` fast path is tried, not assumed, in the order the GPU's plan gives (`fast_paths.PLANS`,
keyed by compute capability): an FA3 or FP8 block that fails to export, compile, load or match eager
falls back to the plan's next step (FP8 row -> per tensor -> bf16, FA3 -> SDPA) with the reason in
the report; only the plain bf16 SDPA block has no fallback.

We use torch's AOTI API (`torch.export.export`, `torch._inductor.aoti_compile_and_package`, the
package loader behind `aoti_load_package` (see `blocks.load_runner`), `load_constants`) rather than
`spaces.aoti_*`, which wrap the same steps: we verify packages before loading them, skip torch's
CPU ISA probe at load, check every call's inputs, and run on CPU-only torch builds too.

    python compile.py --model assets/tiny-flux                      # compile, check, print the report
    python compile.py --model assets/tiny-flux --save packages      # ... and save the packages
    python compile.py --model assets/tiny-flux --load packages      # bind saved packages (compile if stale)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from aot import Options, Target, load_pipeline, optimize_, stops_in_one_line


def main(argv: list[str] | None = None) -> int:
    """The command line: compile (or load) on one device, check, print the report. A setting that
    cannot work stops it with one line (`options.stops_in_one_line`)."""
    parser = argparse.ArgumentParser(
        prog="compile.py",
        description=__doc__,
        parents=[Options.parser()],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    args = parser.parse_args(argv)
    with stops_in_one_line(parser):
        options = Options.from_env(args)
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
        target = Target.of(pipe, options)
        start = time.perf_counter()
        report = optimize_(pipe, options, target=target)
    ready = time.perf_counter() - start
    side = options.min_side
    pipe(**target.family.capture_call(pipe, "a test", side, side), output_type="latent")  # loads + binds every block
    print(report)
    first_step = time.perf_counter() - start
    print(f"packages {report.source} in {ready:.1f} s; first step at {side}x{side} done after {first_step:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

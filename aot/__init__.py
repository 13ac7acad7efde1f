"""The engine behind app.py and compile.py: regional ahead-of-time compilation of a diffusers
pipeline's transformer, as the recipe's verbs, with our contract checks, fingerprints and fallbacks.

    load_pipeline    the pipeline, checked before any weight loads (pipeline.py)
    Target           what a pipeline is compiled for and served with, worked out once (target.py)
    capture_blocks   each repeated block class's real inputs, from real pipeline calls (export.py)
    compile_blocks   capture + export + compile: one weights-less package per block class (export.py)
    save_packages    packages to a folder, fingerprinted; load_packages back, verified (packages.py)
    apply_           every block runs its class's package bound to its own weights (blocks.py)
    graph_step_      the transformer step captured once per shape as a CUDA graph (graphs.py)
    optimize_        load or compile (on ZeroGPU in the startup's GPU call), apply, graph, save (optimize.py)
    Space            serving: a request's checks, its GPU call, its notes (space.py)
    Options          every setting, each a flag and an environment variable (options.py)

README.md's file list says what each module does; zerogpu.py, what runs where on ZeroGPU.
"""

import spaces  # noqa: F401, I001  (first: on ZeroGPU it patches torch before anything can touch CUDA)

from aot.blocks import apply_
from aot.export import capture_blocks, compile_blocks
from aot.graphs import graph_step_
from aot.optimize import optimize_
from aot.options import Options, stops_in_one_line
from aot.packages import load_packages, save_packages
from aot.pipeline import load_pipeline
from aot.space import Space
from aot.target import Target

__all__ = [
    "Options",
    "Space",
    "Target",
    "apply_",
    "capture_blocks",
    "compile_blocks",
    "graph_step_",
    "load_packages",
    "load_pipeline",
    "optimize_",
    "save_packages",
    "stops_in_one_line",
]

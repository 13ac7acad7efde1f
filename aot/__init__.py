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

Each verb's module is imported when the verb is first used (`from aot import Space` imports space.py
and what it needs), so that a process needing one module (`import aot.packages`) does not import the
whole engine (gradio, diffusers). `spaces` is imported here, before any of them: every import of the
engine runs this file first.

README.md's file list says what each module does; zerogpu.py, what runs where on ZeroGPU.
"""

import importlib

import spaces  # noqa: F401  (first: on ZeroGPU it patches torch before anything can touch CUDA)

# Each public verb and the module that defines it.
_VERBS = {
    "Options": "aot.options",
    "Space": "aot.space",
    "Target": "aot.target",
    "apply_": "aot.blocks",
    "capture_blocks": "aot.export",
    "compile_blocks": "aot.export",
    "graph_step_": "aot.graphs",
    "load_packages": "aot.packages",
    "load_pipeline": "aot.pipeline",
    "optimize_": "aot.optimize",
    "save_packages": "aot.packages",
    "stops_in_one_line": "aot.options",
}
__all__ = list(_VERBS)


def __getattr__(name: str):
    """A verb of `_VERBS`, from its module (imported on first use); anything else is not here, which
    lets `from aot import lora` import the submodule."""
    if name not in _VERBS:
        raise AttributeError(f"module 'aot' has no attribute {name!r}")
    return getattr(importlib.import_module(_VERBS[name]), name)

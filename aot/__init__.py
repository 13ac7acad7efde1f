"""The engine behind app.py and compile.py: regional ahead-of-time compilation of a diffusers
pipeline's transformer, as the recipe's verbs, with our contract checks, fingerprints and fallbacks.

    load_pipeline    the pipeline, checked before any weight loads (pipeline.py)
    load_pipelines   one per serving GPU (replicas.py)
    Target           what a pipeline is compiled for and served with, worked out once (target.py)
    Trials           the GPU's plan of fast-path trials, resolved once on the real card (plans.py)
    compile_blocks   capture + export + compile: one weights-less package per block class (export.py)
    load_saved       saved packages that match this model and GPU, verified (loading.py)
    save_and_push    packages to a folder, fingerprinted, atomically, and to the Hub (saving.py)
    apply_           every block runs its class's package on its own weights; CUDA graphs (apply.py)
    Server           serving: a request's defaults, checks and notes, and its pipeline call (server.py)
    Options          every setting, each a flag and an environment variable (options.py)

Each verb's module is imported when the verb is first used (`from aot import Server` imports
server.py and what it needs), so that a process needing one module (`import aot.loading`) does
not import the whole engine (gradio, diffusers). `spaces` is imported here, before any of them:
every import of the engine runs this file first.

An import kept in a function says why at the import: `# heavy: at first use` marks a library that
takes a second or more to import (diffusers, torchao, peft, transformers, gradio, Inductor's
compiler), kept in the function that uses it so that importing one module stays cheap. No import
is kept local to hide a circle: pyproject.toml's contracts (`lint-imports`) forbid circles and
hold the layers README.md's file map shows.
zerogpu.py says what runs where on ZeroGPU.
"""

import importlib

import spaces  # noqa: F401  (first: on ZeroGPU it patches torch before anything can touch CUDA)

# Each public verb and the module that defines it.
_VERBS = {
    "Compiled": "aot.compiled",
    "Limits": "aot.server",
    "Options": "aot.options",
    "Server": "aot.server",
    "Target": "aot.target",
    "Trials": "aot.plans",
    "apply_": "aot.apply",
    "compile_blocks": "aot.export",
    "gpu_model": "aot.replicas",
    "load_pipeline": "aot.pipeline",
    "load_pipelines": "aot.replicas",
    "load_saved": "aot.loading",
    "save_and_push": "aot.saving",
    "usage_errors": "aot.options",
}
__all__ = list(_VERBS)


def __getattr__(name: str):
    """A verb of `_VERBS`, from its module (imported on first use); anything else is not here, which
    lets `from aot import lora` import the submodule."""
    if name not in _VERBS:
        raise AttributeError(f"module 'aot' has no attribute {name!r}")
    return getattr(importlib.import_module(_VERBS[name]), name)

"""CUDA graphs around the transformer step: capture once per input shape, replay every later step.

A compiled step is one AOTI call per block (57 for FLUX.1-dev) plus the eager code between them,
each a series of kernel launches; the GPU idles in the gaps (profiled on the H200: see
BENCHMARKS.md). A CUDA graph replays the same kernels as one launch. The compiled blocks allow
it: their packages are loaded with single-threaded runners (torch's AOTI runner mode for graph
capture; see `runner.load_runner`).

The first call at a new shape runs as usual (its output is the answer; it also warms up the
kernels), then the step is captured on copies of its inputs and replayed once: the replay must
reproduce that output, or graphs are switched off with the reason logged. A first call whose output
is not finite (NaN from a bad input) is not captured: no replay could match it, and one bad request
must not cost every later one its graph; the next call at that shape tries again. That check replay is a
whole extra step, so it runs once per shape and process lineage: a shape checked here, or on
ZeroGPU in an earlier worker (`VERIFIED`), is captured without it. Later calls with that shape copy
their inputs into the graph's static inputs and replay. Inputs and outputs may be
nested (lists of latents, dicts of keyword arguments): the graph keeps the flattened leaves. Calls
a graph cannot stand for run as usual: gradients on, `return_dict=True`, a value that is neither a
tensor nor a plain constant (e.g. a LoRA scale in `joint_attention_kwargs` is a float, so it keys
its own graph), or tensors off the GPU.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import torch
from torch.utils import _pytree as pytree

from aot import zerogpu
from aot.blocks import forward_signature, patch_forward, rel_error
from aot.costs import COSTS
from aot.families import graph_safe_

log = logging.getLogger("graphs")

# Graphs kept, least recently used evicted first. One graph per image size: a Space serving a few
# sizes keeps them all. They share one memory pool for what runs inside them; each also keeps a
# copy of its step's inputs and outputs (mostly the text embeddings; the size in BENCHMARKS.md).
MAX_GRAPHS = 8
# A replay runs the same kernels on the same inputs as the step it was captured from, so it matches
# that step to rounding; anything more means the graph computes something else.
MAX_REL_ERROR = 1e-3
# Graph keys (`_key`) whose check replay matched its step: the same packages at the same shapes
# compute the same graph in every process of this Space, so each shape is checked once. On ZeroGPU
# a worker's new keys come back to the main process with each call's result (`zerogpu.carry_back`),
# and every later worker, forked from it, inherits them: a new worker's first step then costs a
# capture, not a capture and a check step.
VERIFIED: set[tuple] = set()
zerogpu.carry_back("checked CUDA graph shapes", lambda: VERIFIED, VERIFIED.update)


class GraphedStep:
    """Replaces a transformer's `forward` (called with keyword arguments, as diffusers pipelines do).

    Returns the same tuple the transformer returns with `return_dict=False`, as fresh tensors (so a
    second call, e.g. true-CFG's negative pass, does not overwrite the first one's output).

    Not thread-safe: one step at a time (`app.py` serves one request at a time).

    Raises:
        RuntimeError: capture or its check failed and `strict` (CUDA graphs explicitly requested):
            at every call of that size. Without `strict` the reason is logged once, the graphs are
            freed, and every later call runs as usual.
    """

    def __init__(self, module: torch.nn.Module, strict: bool = False):
        self.step = type(module).forward.__get__(module)  # the forward to capture
        self.signature = forward_signature(module)
        self.strict = strict
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, list[Any], tuple]] = OrderedDict()
        self.pool = None
        self.failed: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed:
            return self.step(*args, **kwargs)
        kwargs = dict(self.signature.bind(*args, **kwargs).arguments)  # a pipeline may pass inputs by position
        leaves, tree = pytree.tree_flatten(kwargs)
        key = _key(kwargs, leaves, tree)
        if key is None:
            return self.step(**kwargs)
        if key not in self.graphs:
            out = self.step(**kwargs)
            if _finite(out):
                self._capture(key, leaves, tree, out)
            else:  # no replay could match it: not a reason to give up graphs for every later call
                log.warning("the step gave NaN or inf at a new shape: not captured; the next call at it tries again")
            return out
        self.graphs.move_to_end(key)
        graph, inputs, outputs = self.graphs[key]
        for static, value in zip(inputs, leaves, strict=True):
            if isinstance(value, torch.Tensor):
                static.copy_(value)
        graph.replay()
        return pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, outputs)  # nested outputs too (lists)

    def _capture(self, key: tuple, leaves: list[Any], tree: pytree.TreeSpec, expected: tuple) -> None:
        """Capture the step on copies of the inputs (`leaves` of `tree`), then replay it once: it
        must give `expected`. Timed (`COSTS`) from when the step that gave `expected` has finished on
        the GPU: `torch.cuda.graph` waits for it first, and that wait is the step's time, not the capture's."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        inputs = [v.clone() if isinstance(v, torch.Tensor) else v for v in leaves]
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = tuple(self.step(**pytree.tree_unflatten(inputs, tree)))
            COSTS.add("capture", time.perf_counter() - start)
            if key not in VERIFIED:
                start = time.perf_counter()
                graph.replay()
                error = rel_error(outputs, tuple(expected))
                if not error <= MAX_REL_ERROR:
                    raise RuntimeError(
                        f"replay differs from the step by {error:.1e} (relative), above {MAX_REL_ERROR:.0e}"
                    )
                VERIFIED.add(key)
                COSTS.add("check", time.perf_counter() - start)
        except Exception as exc:  # an op that cannot be captured, or a graph that computes something else
            # A failed capture raises again when it ends, before restoring the caller's stream.
            torch.cuda.set_stream(stream)
            cause = exc.__context__ or exc  # the op that broke the capture, not the capture's end
            reason = f"{type(cause).__name__}: {cause}"
            if self.strict:  # every call at this size raises: `on` means graphs or an error
                raise RuntimeError(f"cuda_graphs=on: the step cannot run as a graph: {reason}") from exc
            self.failed = reason
            self.graphs.clear()
            self.pool = None
            log.warning("CUDA graphs off: the transformer step cannot run as a graph (%s)", reason)
            return
        self.pool = graph.pool()
        self.graphs[key] = (graph, inputs, outputs)
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)


def _finite(out: Any) -> bool:
    """Whether every tensor in `out` is finite (one GPU sync: run once per new shape, before its capture)."""
    return all(bool(torch.isfinite(t).all()) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


def _key(kwargs: dict[str, Any], leaves: list[Any], tree: pytree.TreeSpec) -> tuple | None:
    """What a graph is specific to: the inputs' structure (nested lists and dicts, empty ones
    included), every tensor's shape, dtype and device, every other value (e.g. image shapes given as
    tuples); None where a graph cannot stand for the call."""
    if torch.is_grad_enabled() or kwargs.get("return_dict", True):
        return None
    inference_mode = ("inference_mode", torch.is_inference_mode_enabled())  # static inputs are made in that mode
    key: list[Any] = [inference_mode, tree]
    for value in leaves:
        if isinstance(value, torch.Tensor):
            if value.device.type != "cuda":
                return None
            key.append((tuple(value.shape), value.dtype, value.device))
        elif value is None or isinstance(value, (bool, int, float, str)):
            key.append(value)
        else:
            return None
    return tuple(key)


def graph_step_(transformer: torch.nn.Module, strict: bool = False) -> GraphedStep:
    """Patch `transformer.forward` in place to run through CUDA graphs (after `families.graph_safe_`
    removes what in its step a capture refuses); returns the patch."""
    fixed = graph_safe_(transformer)
    if fixed:
        log.info("made capturable: %s", ", ".join(fixed))
    graphed = GraphedStep(transformer, strict)
    patch_forward(transformer, graphed)
    return graphed

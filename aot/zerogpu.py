"""ZeroGPU: what runs where, and `gpu()`, the one way this template hands work to a GPU.

On a ZeroGPU Space (`SPACES_ZERO_GPU=true`) `import spaces` emulates CUDA in the main process:
`.to("cuda")` makes emulated tensors that alias CPU memory, and `torch.cuda` answers from a table
in `spaces` (not from the real card). Each `@spaces.GPU` call forks a worker from the calling
thread; the worker gets the real GPU, moves the weights onto it and runs the function. Arguments and
results are pickled across the fork; a worker is reused while the service says it is idle, and the
service kills workers whenever it wants the GPU back (spaces 0.51.3, `spaces/zero/wrappers.py`).

What runs where, in this template:

    main process (never initialises CUDA)           GPU worker
    ---------------------------------------------   -------------------------------------------------
    load the weights (`.to("cuda")`: emulated);     startup (`optimize._load_or_compile`): the
    no CPU ISA probe (a CUDA compile needs none:    text encoders' FP8 trial, then the card's plan
    `native.needs_probe`)                          of trials (attention, FP8), load + verify saved
                                                     packages or capture + export + compile; only
                                                     the packages (bytes) and decisions cross back
    apply_: FP8-quantize the blocks' and the text
    encoders' weights, patch each block's forward
    (no package is loaded here; the FA3 kernel and
    AOTI's runner are imported: workers inherit
    them), patch the step for CUDA graphs; log
    what a new worker moves
    at launch, spaces packs the weights to disk     each request (`Space.infer`): on a new worker,
                                                     spaces moves the weights to the GPU; the first
                                                     call of each block class loads its package
                                                     (importing nothing), each block binds its
                                                     tensors before it runs; the first step of a
                                                     size captures its CUDA graph; all redone by
                                                     every new worker, never by a reused one
                                                     (`zerogpu-call` lines)

Large objects (the pipeline) reach the worker through fork, as module state, never as arguments:
pickling an emulated CUDA tensor fails, and a module pickled from a Gradio thread arrives with
empty storage. Outside ZeroGPU `spaces.GPU` returns the function unchanged and all of it runs in one
process.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import gradio as gr
import spaces
from spaces.config import Config

ON_ZEROGPU: bool = Config.zero_gpu  # SPACES_ZERO_GPU=1/t/true, read by spaces at import
log = logging.getLogger("zerogpu")
# The longest a startup call may hold the GPU: the recipe's maximum for `@spaces.GPU` at import time.
STARTUP_SECONDS = 1500
# Above this many bytes packed at launch spaces makes `xlarge` its default size (`xlarge_threshold` of
# the RTX Pro 6000 entry in spaces 0.51.3's zero/configs.json: 42 GiB of the half card's 48 GB).
LARGE_MAX_BYTES = 45_097_156_608

F = TypeVar("F", bound=Callable[..., Any])


class WorkerError(gr.Error):
    """Carries an exception raised in the GPU worker back to the caller, whole.

    spaces re-raises a `gr.Error` from the worker as it is, but any other exception only by its
    class name ("ZeroGPU worker error: RuntimeError"). The worker wraps the exception in this, and
    `gpu()` raises the original again in the caller. spaces still releases the GPU with
    `fail=True`, so the service replaces that worker.
    """

    def __init__(self, error: BaseException, worker_traceback: str = ""):
        super().__init__(f"{type(error).__name__}: {error}", print_exception=False)
        self.error, self.worker_traceback = error, worker_traceback

    def __reduce__(self):
        return WorkerError, (self.error, self.worker_traceback)


def gpu(fn: F, *, duration: int | Callable[..., int], size: str | None = None) -> F:
    """`spaces.GPU(fn, duration=duration, size=size)`, with the worker's exceptions raised whole.

    Args:
        fn: the function to run on the GPU. Its arguments and result are pickled on ZeroGPU: pass
            options and numbers, read large objects from module state.
        duration: seconds the call may hold the GPU, or a function of `fn`'s arguments that returns
            them (spaces multiplies it by the card's duration factor, 1.5 on a `large` Blackwell
            half card: `spaces/zero/configs.json`).
        size: `large` (half an RTX Pro 6000 Blackwell, 48 GB), `xlarge` (the whole card, 96 GB), or
            `auto`/None: spaces' default (`large`, `xlarge` past `LARGE_MAX_BYTES` packed).

    Returns:
        `fn` itself outside ZeroGPU; on ZeroGPU a function that schedules a worker, runs `fn` there,
        and raises in the caller the exception `fn` raised (its type and message; the worker's
        traceback is added as a note). `gr.Error`s pass through as spaces passes them. The CUDA
        graph shapes the worker has checked (`graphs.VERIFIED`) come back with the result, so
        workers forked later skip those check replays.
    """
    if not ON_ZEROGPU:
        return fn

    from aot.graphs import VERIFIED

    @functools.wraps(fn)
    def in_worker(*args: Any, **kwargs: Any) -> tuple[Any, set[tuple]]:
        try:
            with _logged(fn.__name__):
                return fn(*args, **kwargs), VERIFIED  # what later workers need not check again
        except gr.Error:
            raise
        except Exception as exc:
            raise WorkerError(_picklable(exc), traceback.format_exc()) from None

    scheduled = spaces.GPU(in_worker, duration=duration, size=None if size == "auto" else size)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        _asked.set(time.time())  # a worker forked for this call inherits it (fork copies this thread's context)
        try:
            result, verified = scheduled(*args, **kwargs)
            VERIFIED.update(verified)  # workers forked from now on inherit them
            return result
        except WorkerError as carried:
            error = carried.error
            error.add_note(f"raised in the ZeroGPU worker:\n{carried.worker_traceback}")
            raise error from None

    return call  # type: ignore[return-value]


# When the calling thread asked for a GPU (wall clock), and how many calls this process has run: a
# worker's first call is a new worker's, whose wait includes spaces moving the weights to the GPU.
# A context variable: spaces runs the call in a thread of the worker under a copy of the context of
# the thread that forked it, and concurrent requests in the main process each keep their own.
_asked: contextvars.ContextVar[float] = contextvars.ContextVar("asked")
_calls = 0


@contextlib.contextmanager
def _logged(name: str):
    """Log one `zerogpu-call {json}` line per call in a worker: whether the worker is new, the
    seconds from asking for the GPU to the call (a new worker's, which includes moving the weights), the
    call's seconds, what compiled blocks spent in it (`blocks.COSTS`: package loads, binds,
    CUDA graph captures and check replays) and the modules it imported (`imported`: each new worker
    imports them again, so whatever a call needs is imported before the fork). bench.py's zerogpu
    rows read these lines."""
    from aot.blocks import COSTS

    global _calls
    new, waited = _calls == 0, time.time() - _asked.get(time.time())
    before, start, modules = dataclasses.replace(COSTS), time.perf_counter(), set(sys.modules)
    try:
        yield
    finally:
        _calls += 1
        spent = {k: round(v - getattr(before, k), 4) for k, v in dataclasses.asdict(COSTS).items()}
        # A reused worker runs each call under a copy of its forking thread's context: the ask it
        # sees is its first call's, so only a new worker's wait is known.
        wait = round(waited, 3) if new else None
        line = {"fn": name, "pid": os.getpid(), "new_worker": new, "call": _calls, "wait_s": wait}
        line.update(call_s=round(time.perf_counter() - start, 3), **spent)
        line["imported"] = sorted(set(sys.modules) - modules)
        log.info("zerogpu-call %s", json.dumps(line))


def weight_bytes(pipe: Any) -> int:
    """Bytes of the weights of `pipe`'s components (`blocks.tensor_bytes`): on ZeroGPU what spaces
    packs at launch and a new worker moves to the GPU before its first call. A quantized weight counts
    its inner tensors (torchao's FP8: one byte a value plus its scales)."""
    import torch

    from aot.blocks import tensor_bytes

    return sum(tensor_bytes(c) for c in pipe.components.values() if isinstance(c, torch.nn.Module))


def check_size(pipe: Any, size: str) -> str:
    """Log what a new worker moves and which ZeroGPU size it fits (`size_advice`); returns the line."""
    line, warn = size_advice(weight_bytes(pipe), size)
    (log.warning if warn and ON_ZEROGPU else log.info)("%s", line)
    return line


def size_advice(moved: int, size: str) -> tuple[str, bool]:
    """One line on `moved` bytes of weights under `AOT_GPU_SIZE=size`, and whether it is a warning:
    `auto` becomes `xlarge` (twice the quota) past `LARGE_MAX_BYTES`, an explicit `large` may not
    hold them, and `xlarge` below it takes the whole card for nothing."""
    amount = f"{moved / 1e9:.1f} GB" if moved >= 1e8 else f"{moved / 1e6:.3f} MB"
    line, limit = f"a new ZeroGPU worker moves {amount} of weights to the GPU", f"{LARGE_MAX_BYTES / 2**30:.0f} GiB"
    if moved <= LARGE_MAX_BYTES:
        if size == "xlarge":
            return f"{line}: large would hold them; AOT_GPU_SIZE=xlarge takes the whole card at twice the quota", True
        return f"{line}: fits large (spaces keeps large up to {limit} packed)", False
    if size == "auto":
        return f"{line}, over {limit}: spaces runs every GPU call on xlarge (the whole card, twice the quota)", True
    if size == "large":
        return f"{line}, over {limit}: AOT_GPU_SIZE=large (48 GB) may not hold them; use auto or xlarge", True
    return f"{line}, over {limit}: xlarge", False


def _picklable(exc: Exception) -> Exception:
    """`exc` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")

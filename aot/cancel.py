"""Stopping a request nobody waits for any more, at its next denoising step.

gradio lets an app know a request was cancelled (a client's `job.cancel()`, the page's stop) by
cancelling the asyncio task that awaits the app's function. A plain function runs in a worker
thread that no cancel reaches, so the request ran to its end and wrote its image. So app.py's
`generate` is a coroutine that runs the request in a thread (`cancellable`) and, when its task is
cancelled, raises a stop flag that the denoising loop reads after every step (`on_step_end`, a
diffusers `callback_on_step_end`): the pipeline skips its remaining steps, nothing is written, and
on ZeroGPU the GPU is released at once, the worker kept.

The flags are one array of shared memory made when this module is imported, before any GPU worker
is forked: a ZeroGPU worker reads the same bytes the main process writes, so a flag's index (an
int) is all a request carries across the fork. What gradio does not report cannot be stopped: a
`POST /call/<api>` whose result is never fetched, or a page closed mid-request, runs to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import threading
from collections.abc import Callable, Iterator
from typing import Any

# Requests that can be stopped at once: beyond it a request runs unstoppable (index -1). gradio runs
# at most its concurrency limit plus its queue's size at once (40 + 20 on ZeroGPU).
SLOTS = 1024
_FLAGS = multiprocessing.RawArray(ctypes.c_bool, SLOTS)  # shared with every process forked later
_free = list(range(SLOTS))
_lock = threading.Lock()


@contextlib.contextmanager
def stop_flag() -> Iterator[int]:
    """A cleared stop flag for one request, as its index into the shared flags (-1: none free)."""
    with _lock:
        index = _free.pop() if _free else -1
    if index >= 0:
        _FLAGS[index] = False
    try:
        yield index
    finally:
        if index >= 0:
            with _lock:
                _free.append(index)


def stopped(index: int) -> bool:
    """Whether the request holding flag `index` was stopped (never, for -1)."""
    return index >= 0 and _FLAGS[index]


def on_step_end(index: int) -> Callable[[Any, int, Any, dict], dict]:
    """A diffusers `callback_on_step_end` that interrupts the pipeline once flag `index` is raised:
    its loop skips the steps left (`pipe.interrupt`), in this process or a forked GPU worker."""

    def interrupt_if_stopped(pipe: Any, step: int, timestep: Any, tensors: dict) -> dict:
        if stopped(index):
            pipe._interrupt = True
        return tensors

    return interrupt_if_stopped


async def cancellable(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args, index)` in a worker thread, `index` a stop flag of its own; returns its result.

    If the awaiting task is cancelled (gradio's cancel), the flag is raised, `fn` is awaited to its
    end (the pipeline stops at its next step; a replica it holds is free only then), and the
    cancellation goes on.
    """
    with stop_flag() as index:
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args, index))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            if index >= 0:
                _FLAGS[index] = True
            with contextlib.suppress(Exception):
                await work
            raise

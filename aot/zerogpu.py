"""ZeroGPU: what runs where, and `worker`, what this template adds to a `@spaces.GPU` function.

On a ZeroGPU Space (`SPACES_ZERO_GPU=true`) `import spaces` emulates CUDA in the main process:
`.to("cuda")` makes emulated tensors that alias CPU memory, and `torch.cuda` answers from a table
in `spaces` (not from the real card). Each `@spaces.GPU` call forks a worker from the calling
thread; the worker gets the real GPU, moves the weights onto it and runs the function. Arguments and
results are pickled across the fork; a worker is reused while the service says it is idle, and the
service kills workers whenever it wants the GPU back (spaces 0.51.3, `spaces/zero/wrappers.py`).

What runs where, in this template:

    main process (never initialises CUDA)           GPU worker
    ---------------------------------------------   -------------------------------------------------
    load the weights (`.to("cuda")`: emulated)       startup (compile.py's `compile_transformer`):
                                                     the text encoders' FP8 trial, the card's plan
                                                     of trials (attention, FP8, CUDA graphs), load
                                                     and verify saved packages or capture + export +
                                                     compile; only the packages and the decisions
                                                     cross back
    `apply_`: FP8-quantize the blocks' and the text
    encoders' weights, patch each block's forward
    (no package is loaded here; the FA3 kernel and
    AOTI's runner are imported: workers inherit
    them), patch the step for CUDA graphs
    at launch, spaces packs the weights to disk     each request (app.py's `infer`): a new worker
                                                     moves the weights to the GPU; the first call of
                                                     each block class loads its package, each block
                                                     binds its tensors before it runs; the first
                                                     step of a size captures its CUDA graph; a
                                                     reused worker does none of that

Large objects (the pipeline) reach the worker through fork, as module state or a closure, never as
arguments: pickling an emulated CUDA tensor fails, and a module pickled from a Gradio thread arrives
with empty storage. Outside ZeroGPU `spaces.GPU` returns the function unchanged and all of it runs
in one process.

    @spaces.GPU(duration=60)
    @zerogpu.worker
    def infer(...): ...

`worker` runs inside the worker: it carries the function's exceptions back whole (spaces passes on
only their class name), brings back the state modules registered with `carry_back` (the CUDA graph
shapes a worker checked, graphs.py), and logs one `zerogpu-call` line per call with what the
counters registered with `count_per_call` spent (package loads and binds, costs.py). It imports
no other module of the engine: the modules that own such state register it.

spaces forks a new worker from the request's thread while other requests' threads make TLS contexts
(each call to its device API builds an httpx client), and the worker's first act makes one too.
`fork_safe_tls_contexts`, installed here on ZeroGPU, keeps the two apart.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pickle
import ssl
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from aot.zerogpu_limits import ON_ZEROGPU

log = logging.getLogger("zerogpu")
F = TypeVar("F", bound=Callable[..., Any])

# name -> (what to send back from a worker, how the calling process takes it in): `carry_back`.
_CARRIED: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
# name -> a snapshot of counters ({name: number}) whose change over a call is logged: `count_per_call`.
_COUNTERS: dict[str, Callable[[], dict[str, float]]] = {}


def carry_back(name: str, get: Callable[[], Any], merge: Callable[[Any], None]) -> None:
    """Register state that a worker's call sends back to the process that called it.

    After each call in a worker, `get()` is pickled with the result, and `merge(value)` runs in the
    calling process as the result arrives, so workers forked later inherit it.

    Args:
        name: what it is, unique (a second registration under it replaces the first).
        get: returns the state in the worker (picklable).
        merge: takes it in, in the calling process.
    """
    _CARRIED[name] = (get, merge)


def count_per_call(name: str, snapshot: Callable[[], dict[str, float]]) -> None:
    """Register counters (`snapshot()` returns {counter: number}) whose change over each call in a
    worker goes into its `zerogpu-call` log line."""
    _COUNTERS[name] = snapshot


@functools.cache
def _worker_error() -> type:
    """`WorkerError`, a `gr.Error`: an exception raised in the GPU worker, on its way back.

    spaces re-raises a `gr.Error` from the worker as it is, but any other exception only by its
    class name ("ZeroGPU worker error: RuntimeError"). `worker` wraps the exception in this; once
    unpickled in the calling process it is the original exception again (`__reduce__`), with the
    worker's traceback as a note. spaces still releases the GPU with `fail=True`, so the service
    replaces that worker. Made at the first use: importing this module imports no gradio.
    """
    import gradio as gr  # heavy: at first use

    class WorkerError(gr.Error):
        def __init__(self, error: BaseException, worker_traceback: str = ""):
            super().__init__(f"{type(error).__name__}: {error}", print_exception=False)
            self.error, self.worker_traceback = error, worker_traceback

        def __reduce__(self):
            return _raised_here, (self.error, self.worker_traceback)

    return WorkerError


def _raised_here(error: BaseException, worker_traceback: str) -> BaseException:
    """The worker's exception, unpickled in the calling process: its traceback as a note, and
    `print_exception` off (spaces reads it, as on a `gr.Error`, before raising it)."""
    error.add_note(f"raised in the ZeroGPU worker:\n{worker_traceback}")
    error.print_exception = False
    return error


class _Returned:
    """A call's value on its way back from the worker, with the registered state (`carry_back`);
    unpickled in the calling process it is the value itself (`__reduce__`)."""

    def __init__(self, value: Any, state: dict[str, Any]):
        self.value, self.state = value, state

    def __reduce__(self):
        return _arrived, (self.value, self.state)


def _arrived(value: Any, state: dict[str, Any]) -> Any:
    for name, part in state.items():
        if name in _CARRIED:
            _CARRIED[name][1](part)
    return value


def worker(fn: F) -> F:
    """`fn` as a ZeroGPU worker runs it under `@spaces.GPU` (put it below that decorator).

    Outside ZeroGPU it returns `fn` itself. On ZeroGPU, in the worker: an exception `fn` raises
    reaches the caller whole (its type, message and the worker's traceback as a note: `_worker_error`;
    a `gr.Error` passes as spaces passes it), the state registered with `carry_back` comes back with the result,
    and each call logs one `zerogpu-call {json}` line (`_logged`).

    Args:
        fn: the function to run on the GPU. Its arguments and result are pickled on ZeroGPU: pass
            options and numbers, reach large objects through module state or a closure.
    """
    if not ON_ZEROGPU:
        return fn

    import gradio as gr  # heavy: at first use

    @functools.wraps(fn)
    def in_worker(*args: Any, **kwargs: Any) -> Any:
        try:
            with _logged(fn.__name__):
                value = fn(*args, **kwargs)
        except gr.Error:
            raise
        except Exception as exc:
            raise _worker_error()(_picklable(exc), traceback.format_exc()) from None
        return _Returned(value, {name: get() for name, (get, _) in _CARRIED.items()})

    return in_worker  # type: ignore[return-value]


_TLS_FORK_LOCK = threading.Lock()


def fork_safe_tls_contexts() -> None:
    """Make this process's forks wait for any TLS context being made, and hold new ones during a fork.

    A fork taken while another thread is inside OpenSSL's `SSL_CTX_new` leaves the child a lock that
    no thread of the child will release, and the child's first TLS context then waits forever. On
    ZeroGPU that child is a new worker: spaces forks it from the request's thread while other
    requests' threads build httpx clients (a TLS context each, even with `verify=False`) for the
    device API's /schedule and /release, and the worker builds one for /allow before anything else.
    Seen under tools/zerogpu_harness.py with three visitors at once: a worker stuck in
    `SSLContext.__new__` (spaces 0.51.3, httpx 0.28, OpenSSL 3.0). Three threads making contexts
    beside 300 forks that each make one left 6-7 children hung without this and none with it (2-core
    CPU, 2026-12-06; tests/test_zerogpu.py repeats it).

    Wraps `ssl.SSLContext.__new__` (every context, `ssl.create_default_context`'s too) in a lock
    that `os.register_at_fork` takes before each fork and releases after it, in parent and child.
    Call it in the main process before the first fork; a second call does nothing.
    """
    if getattr(ssl.SSLContext.__new__, "fork_safe", False):
        return
    make = ssl.SSLContext.__new__

    def __new__(cls: type, *args: Any, **kwargs: Any) -> ssl.SSLContext:
        with _TLS_FORK_LOCK:
            return make(cls, *args, **kwargs)

    __new__.fork_safe = True  # type: ignore[attr-defined]
    ssl.SSLContext.__new__ = staticmethod(__new__)  # type: ignore[method-assign,assignment]
    os.register_at_fork(
        before=_TLS_FORK_LOCK.acquire,
        after_in_parent=_TLS_FORK_LOCK.release,
        after_in_child=_TLS_FORK_LOCK.release,
    )


if ON_ZEROGPU:
    fork_safe_tls_contexts()


# When this process was forked (wall clock), and how many calls it has run: a worker's first call
# is a new worker's, whose wait since the fork is spaces moving the weights to the GPU.
_forked_at: float | None = None
_calls = 0


def _mark_fork() -> None:
    global _forked_at, _calls
    _forked_at, _calls = time.time(), 0


os.register_at_fork(after_in_child=_mark_fork)


@contextlib.contextmanager
def _logged(name: str):
    """Log one `zerogpu-call {json}` line per call in a worker: whether the worker is new, the
    seconds from its fork to the call (a new worker's: spaces moving the weights to the GPU), the
    call's seconds, what the registered counters spent in it (`count_per_call`), and how many
    modules it imported (`imported`; their names at debug level): each new worker imports them
    again, so whatever a call needs is imported before the fork. tools/bench.py reads these lines."""
    global _calls
    new = _calls == 0
    wait = round(time.time() - _forked_at, 3) if new and _forked_at is not None else None
    before = {key: snapshot() for key, snapshot in _COUNTERS.items()}
    start, modules = time.perf_counter(), set(sys.modules)
    try:
        yield
    finally:
        _calls += 1
        line = {"fn": name, "pid": os.getpid(), "new_worker": new, "call": _calls, "wait_s": wait}
        line["call_s"] = round(time.perf_counter() - start, 3)
        for key, snapshot in _COUNTERS.items():
            line.update({k: round(v - before[key].get(k, 0), 4) for k, v in snapshot().items()})
        imported = sorted(set(sys.modules) - modules)
        line["imported"] = len(imported)
        log.info("zerogpu-call %s", json.dumps(line))
        if imported:
            log.debug("zerogpu-call %s imported %s", name, ", ".join(imported))


def _picklable(exc: Exception) -> Exception:
    """`exc` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")

"""Compile block classes one after another, each class's C++ build under way while the next one
lowers.

An AOTInductor compile is single-threaded Python (export, lowering, code generation) and then a
C++ build of the package's wrapper, a compiler process the Python only waits for (4-8 s on the
H200 host for a FLUX.1-dev block, BENCHMARKS.md). Two compiles cannot run in threads of one
process (concurrent exports and lowerings fail, BENCHMARKS.md), and a second process pays its own
imports and shares the host. So `overlapped` runs the next job *during* the wrapper build: the
job starts on a thread of its own, the compiling thread runs the compiler and then waits for the
job, which may run the one after it during its own build, and so on. One thread runs Python at a
time, the contexts a compile enters (Inductor's settings, the node-meta state) are left in the
order they were entered, and a job's result and error stay its own, given at its turn.

    with overlapped([compile_a, compile_b]) as jobs:
        a = jobs[0].result()  # compile_a runs here; compile_b runs during its wrapper build
        b = jobs[1].result()  # compile_b's result (or what it raised)

A job runs with its caller's grad and inference modes and CUDA device wherever it runs (a new
thread starts with grad on, no inference mode, device 0). Jobs that compile the same code must name
their generated files apart (`lowering.compile_package` does): Inductor holds a file lock named after
the files through the build, and the job would wait for the build that waits for it. Inductor's
CUTLASS GEMM kernels (a `max_autotune_gemm_backends` choice; `lowering.INDUCTOR_CONFIGS` leaves them
off) are gathered in one process-wide list that a package takes after its wrapper build: with them on,
a job's kernels would land in the package before it, so the jobs must not overlap.

Torch 2.11's `_inductor/codecache.py` names the seam: `AotCodeCompiler.compile`, the only writer of
a `wrapper.cpp`, builds it with a `CppBuilder` whose target ends in `.wrapper.o`. Where that
changes, the jobs run one after another (slower, never wrong), and `tests/test_overlap.py` fails.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import torch

T = TypeVar("T")
WRAPPER_OBJECT = ".wrapper.o"  # what the package's wrapper build writes (AotCodeCompiler.compile)
_state = threading.local()  # .queue: the `_Queue` whose jobs run during this thread's wrapper builds


@dataclasses.dataclass
class _Queue:
    """The jobs not yet run, and the caller's modes they run with."""

    jobs: collections.deque
    grad: bool
    inference: bool


class _Patch:
    """`CppBuilder.build` patched while any thread is inside `overlapped`, restored by the last to leave
    (contexts on two threads may close in either order)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.users = 0
        self.build: Callable[[Any], None] | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        from torch._inductor import cpp_builder  # heavy: at first use

        with self.lock:
            if self.users == 0:
                self.build = cpp_builder.CppBuilder.build
                cpp_builder.CppBuilder.build = _overlapping(self.build)
            self.users += 1
        try:
            yield
        finally:
            with self.lock:
                self.users -= 1
                if self.users == 0:
                    cpp_builder.CppBuilder.build = self.build


_patch = _Patch()


class Job(Generic[T]):
    """One function run at most once: by `result()`, or earlier during a package's wrapper build."""

    def __init__(self, function: Callable[[], T]):
        self.function = function
        self.ran = False
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        """Run the function now unless it ran; keep its value or the exception it raised."""
        if self.ran:
            return
        self.ran = True
        try:
            self._value = self.function()
        except BaseException as exc:  # SystemExit on a job's thread too: `result()` gives it to the caller
            self._error = exc

    def result(self) -> T:
        """The function's value (running it now if it has not run).

        Raises:
            BaseException: what the function raised, wherever it ran, at every call.
        """
        self.run()
        if self._error is not None:
            raise self._error
        return self._value


@contextlib.contextmanager
def overlapped(functions: Sequence[Callable[[], T]]) -> Iterator[list[Job[T]]]:
    """Jobs for `functions`, to be taken in order with `result()`: while a job's AOTInductor package
    builds its wrapper's C++, the next job not yet run runs (module docstring). A job that compiles
    no package leaves the next one to its own `result()`; jobs left at exit never run.

    Only this thread's package compiles overlap; other threads' C++ builds (the precompiled headers,
    `portability.compile_scope`) run as they would. No job is still running once the context has exited.
    """
    jobs = [Job(f) for f in functions]
    outer = getattr(_state, "queue", None)
    _state.queue = _Queue(collections.deque(jobs), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    try:
        with _patch.held():
            yield jobs
    finally:
        _state.queue = outer


def _overlapping(build: Callable[[Any], None]) -> Callable[[Any], None]:
    """`CppBuilder.build`, which for a package's wrapper, with a job waiting, runs the job on a
    thread of its own while the compiler runs, and returns once both are done."""

    def build_overlapped(builder: Any) -> None:
        queue = getattr(_state, "queue", None)
        while queue and queue.jobs and queue.jobs[0].ran:
            queue.jobs.popleft()
        if not (queue and queue.jobs and str(builder.get_target_file_path()).endswith(WRAPPER_OBJECT)):
            return build(builder)
        job = queue.jobs.popleft()
        ended = threading.Event()
        runner = threading.Thread(target=_run_at_top, args=(job, queue, _device(), ended), name="overlapped-compile")
        try:
            runner.start()
            return build(builder)
        finally:
            _wait(runner, ended)

    return build_overlapped


def _run_at_top(job: Job[Any], queue: _Queue, device: int | None, ended: threading.Event) -> None:
    """Run `job` on this (new) thread: its thread state is a top-level caller's, not that of the
    compile whose build it waits beside (Inductor's compile context, its virtualized graph state and
    Python dispatcher are per thread, and Inductor does not nest a compile in another: a job run on
    the compiling thread fails an assertion in torch 2.11). The compiling thread only waits for the
    compiler and this job, so one thread runs Python at a time and every context a compile entered
    is left in order. `queue`: the jobs after this one, for this job's own wrapper build, and the
    modes of the context's caller. `ended` is set once the job has ended."""
    try:
        _state.queue = queue
        cuda = torch.cuda.device(device) if device is not None else contextlib.nullcontext()
        modes = torch.inference_mode(queue.inference)  # first: inference_mode(False) turns grad on
        with cuda, modes, torch.set_grad_enabled(queue.grad):
            job.run()
    finally:
        ended.set()


def _wait(runner: threading.Thread, ended: threading.Event) -> None:
    """Wait for `runner`'s job to end, through Ctrl-C (raised once it has): a thread cannot be stopped,
    and a job left running would run Python beside its caller after the context exits. Waits on
    `ended`, not on `runner.join()`: Python 3.11's join, interrupted, marks a running thread stopped
    (seen on 3.11.7)."""
    interrupted = None
    while runner.ident is not None and not ended.is_set():
        try:
            ended.wait()
        except KeyboardInterrupt as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted


def _device() -> int | None:
    """The calling thread's CUDA device (a new thread starts on device 0), None before CUDA starts."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None

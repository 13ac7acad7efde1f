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

Torch 2.11's `_inductor/codecache.py` names the seam: `AotCodeCompiler.compile`, the only writer of
a `wrapper.cpp`, builds it with a `CppBuilder` whose target ends in `.wrapper.o`. Where that
changes, the jobs run one after another (slower, never wrong), and `tests/test_overlap.py` fails.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import torch

T = TypeVar("T")
WRAPPER_OBJECT = ".wrapper.o"  # what the package's wrapper build writes (AotCodeCompiler.compile)
_state = threading.local()  # .queue: jobs to run during this thread's wrapper builds


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
        except Exception as exc:
            self._error = exc

    def result(self) -> T:
        """The function's value (running it now if it has not run).

        Raises:
            Exception: what the function raised, wherever it ran.
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
    `native.compile_scope`) run as they would.
    """
    from torch._inductor import cpp_builder

    jobs = [Job(f) for f in functions]
    outer = getattr(_state, "queue", None)
    _state.queue = collections.deque(jobs)
    build = cpp_builder.CppBuilder.build
    cpp_builder.CppBuilder.build = _overlapping(build)
    try:
        yield jobs
    finally:
        cpp_builder.CppBuilder.build = build
        _state.queue = outer


def _overlapping(build: Callable[[Any], None]) -> Callable[[Any], None]:
    """`CppBuilder.build`, which for a package's wrapper, with a job waiting, runs the job on a
    thread of its own while the compiler runs, and returns once both are done."""

    def build_overlapped(builder: Any) -> None:
        queue = getattr(_state, "queue", None)
        while queue and queue[0].ran:
            queue.popleft()
        if not (queue and str(builder.get_target_file_path()).endswith(WRAPPER_OBJECT)):
            return build(builder)
        job = queue.popleft()
        runner = threading.Thread(target=_run_at_top, args=(job, queue, _device()), name="overlapped-compile")
        runner.start()
        try:
            return build(builder)
        finally:
            runner.join()

    return build_overlapped


def _run_at_top(job: Job[Any], queue: collections.deque, device: int | None) -> None:
    """Run `job` on this (new) thread: its thread state is a top-level caller's, not that of the
    compile whose build it waits beside (Inductor's compile context, its virtualized graph state and
    Python dispatcher are per thread, and Inductor does not nest a compile in another: a job run on
    the compiling thread fails an assertion in torch 2.11). The compiling thread only waits for the
    compiler and this job, so one thread runs Python at a time and every context a compile entered
    is left in order. `queue`: the jobs after this one, for this job's own wrapper build."""
    _state.queue = queue
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        job.run()


def _device() -> int | None:
    """The calling thread's CUDA device (a new thread starts on device 0), None before CUDA starts."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None

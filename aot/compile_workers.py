"""The compile step: AOTInductor turns an exported block into a weights-less package, several block
classes at once.

Each block class is one AOTInductor compile: mostly single-threaded Python (lowering, scheduling,
code generation) and one C++ build of the package's wrapper. The classes share nothing, so they can
compile side by side, but not in threads of one process (Inductor's lowering is not thread-safe:
concurrent exports and compiles in one process fail, BENCHMARKS.md). On the H200 FLUX.1-dev's two
classes took 22 and 10 s one after the other (BENCHMARKS.md); side by side, about the longer one.

`CompileWorkers(count)` starts `count` worker processes at once, so that their imports (torch,
Inductor, the ops an exported block may call) overlap with the caller's capture and exports.
`compile(programs)` compiles the largest program in this process and each other one in a worker,
and returns every package. A worker that cannot do its job (it cannot load the program, it died)
is logged and its program compiled here instead: the package is the same either way, and the caller
checks each one against its eager block.

A worker is this file run as a script, not as `aot.compile_workers`: importing the `aot` package
imports `spaces` (and gradio), and on ZeroGPU `spaces` would emulate CUDA in the worker too. It
reads one job a line on stdin, `{"program": torch.export.save path, "package": .pt2 path to write,
"settings": Inductor settings}`, and answers one line on the stdout it started with; anything else
it prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Inductor settings for every package. Weights stay out of the package: each block binds its own.
INDUCTOR_CONFIGS: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
    # Store a pointwise result that is read more than once when it takes more than 16 ops,
    # instead of recomputing it in every kernel that reads it (Inductor's GPU default: 30). In
    # FLUX's single block the FP8 input of proj_out, cat(attention, gelu_tanh(mlp)), is read by the
    # row-amax and by the cast: one kernel instead of three (BENCHMARKS.md).
    "realize_opcount_threshold": 16,
}
# Modules a worker imports before its first job: they register the ops an exported block may call
# (diffusers' FA3 op `_diffusers_flash_attn_3::_flash_attn_forward`, torchao's FP8 tensors), so
# that `torch.export.load` finds them. A missing one is skipped: a block that calls it fails to load.
WORKER_IMPORTS = ("torch._inductor.compile_fx", "torchao.quantization", "diffusers.models.attention_dispatch")
# The longest a worker's job may take before its program is compiled here instead (seconds): far
# above any compile measured (30 s on the H200), under the startup call's 1500 s.
JOB_TIMEOUT_S = 600.0


def compile_package(exported: Any, settings: dict[str, Any] | None = None) -> bytes:
    """AOTInductor-compile `exported` (a `torch.export.ExportedProgram`) into a weights-less `.pt2`
    package under `INDUCTOR_CONFIGS` (and `settings`, Inductor settings such as
    `native.settings`); returns its bytes."""
    import torch

    with tempfile.TemporaryDirectory() as tmp, torch._inductor.config.patch(_tuples(settings or {})):
        path = os.path.join(tmp, "package.pt2")
        torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=INDUCTOR_CONFIGS)
        return Path(path).read_bytes()


def worker_count(option: str, device_type: str, classes: int) -> int:
    """How many worker processes a compile of `classes` block classes on `device_type` starts:
    `option` (`Options.compile_workers`) `off`: none; `auto`: one per class beyond the first on CUDA,
    none on a CPU (whose compile is C++ builds that already take the cores: CI has two)."""
    if option == "off" or device_type != "cuda":
        return 0
    return max(classes - 1, 0)


class BlockError(RuntimeError):
    """Block class `block` failed to export, compile, load or run; the cause is `__cause__`."""

    def __init__(self, block: str, cause: BaseException):
        super().__init__(f"{block}: {type(cause).__name__}: {cause}")
        self.block = block


class CompileWorkers:
    """Worker processes that compile exported blocks beside this process (module docstring).

    Use as a context manager: the workers start on entry (their imports overlap with what the caller
    does next) and stop on exit. With `count` 0 every program compiles here.
    """

    def __init__(self, count: int, settings: dict[str, Any]):
        self.count, self.settings = count, settings  # settings: Inductor's, for every compile (native.settings)
        self._workers: list[subprocess.Popen] = []
        self._folder: tempfile.TemporaryDirectory | None = None
        self.log: list[str] = []  # what went to a worker and what came back here instead, one line each

    def __enter__(self) -> CompileWorkers:
        if self.count:
            self._folder = tempfile.TemporaryDirectory(prefix="aot-compile-")
            env = dict(os.environ)  # on ZeroGPU: the GPU the worker was given (CUDA_VISIBLE_DEVICES)
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the caller's imports, the worker's too
            for _ in range(self.count):
                self._workers.append(
                    subprocess.Popen(
                        [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
                    )
                )
        return self

    def __exit__(self, *exc: Any) -> None:
        for worker in self._workers:
            if worker.stdin:
                worker.stdin.close()  # end of jobs: the worker exits
        for worker in self._workers:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        self._workers = []
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def compile(self, programs: dict[str, Any]) -> dict[str, tuple[bytes, float]]:
        """Compile each of `programs` (block class -> `torch.export.ExportedProgram`) under
        `self.settings`; returns class -> (package bytes, seconds its compile took).

        The program with the most graph nodes compiles here, the others in workers while it does;
        with fewer workers than programs, or a worker gone, the rest compile here after it.

        Raises:
            BlockError: a program that failed to compile here (naming its class); a worker's
                failure is logged and its program compiled here instead.
        """
        import torch

        names = sorted(programs, key=lambda n: len(programs[n].graph.nodes), reverse=True)
        sent: dict[str, tuple[subprocess.Popen, Path, float]] = {}
        idle = [w for w in self._workers if w.poll() is None]
        for name in names[1:]:
            if not idle:
                if self.count:  # a worker was started for it and is gone
                    self.log.append(f"{name}: compiled here (no worker running)")
                continue
            program, package = self._paths(name)
            try:
                torch.export.save(programs[name], program)
            except Exception as exc:  # a program torch cannot serialize: this process compiles it
                self.log.append(f"{name}: compiled here (cannot be saved for a worker: {type(exc).__name__}: {exc})")
                continue
            worker = idle.pop(0)
            job = {"program": str(program), "package": str(package), "settings": self.settings}
            try:
                worker.stdin.write(json.dumps(job) + "\n")
                worker.stdin.flush()
            except OSError as exc:  # the worker is gone
                self.log.append(f"{name}: compiled here (worker gone: {exc})")
                continue
            sent[name] = (worker, package, time.perf_counter())
        done = {}
        for name in [n for n in names if n not in sent]:
            done[name] = self._here(name, programs[name])
        for name, (worker, package, start) in sent.items():
            problem = _reply(worker, JOB_TIMEOUT_S - (time.perf_counter() - start))
            if problem is None:
                done[name] = (package.read_bytes(), time.perf_counter() - start)
                self.log.append(f"{name}: compiled in a worker")
            else:
                self.log.append(f"{name}: compiled here (the worker's job failed: {problem})")
                if worker.poll() is None and problem.startswith("no answer"):
                    worker.kill()
                done[name] = self._here(name, programs[name])
        return {name: done[name] for name in programs}

    def _here(self, name: str, program: Any) -> tuple[bytes, float]:
        start = time.perf_counter()
        try:
            return compile_package(program, self.settings), time.perf_counter() - start
        except Exception as exc:
            raise BlockError(name, exc) from exc

    def _paths(self, name: str) -> tuple[Path, Path]:
        assert self._folder is not None
        folder = Path(self._folder.name) / name
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.iterdir():  # an earlier trial's (another FP8 granularity, another kernel)
            stale.unlink()
        return folder / "program.pt2", folder / "package.pt2"


def _reply(worker: subprocess.Popen, timeout: float) -> str | None:
    """Wait for `worker`'s answer to its job: None when the package was written, else why not."""
    assert worker.stdout is not None
    ready, _, _ = select.select([worker.stdout], [], [], max(timeout, 0.0))
    if not ready:
        return f"no answer within {JOB_TIMEOUT_S:.0f} s"
    line = worker.stdout.readline()
    if not line:
        return f"the worker exited ({worker.wait()})"
    reply = json.loads(line)
    return None if reply.get("ok") else reply.get("error", "unknown error")


def _tuples(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings as Inductor takes them: a list (a tuple that went through JSON) as a tuple."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}


def _serve() -> None:
    """The worker's loop (module docstring): import, then one job a line until stdin ends."""
    here = os.path.dirname(os.path.abspath(__file__))  # run as a script, this folder leads sys.path:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # aot's modules are not top-level ones
    answers = os.fdopen(os.dup(1), "w")  # replies go here; anything printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import importlib

    import torch

    for module in WORKER_IMPORTS:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    for line in sys.stdin:
        job = json.loads(line)
        try:
            program = torch.export.load(job["program"])
            Path(job["package"]).write_bytes(compile_package(program, job["settings"]))
            reply: dict[str, Any] = {"ok": True}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        answers.write(json.dumps(reply) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()

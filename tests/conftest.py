"""Shared fixtures: the bundled tiny FLUX pipeline, compiled once per test session (about 20 s on 2 cores)
and saved once, and a way to start the Space as a server."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from aot.apply import apply_, patch_blocks_
from aot.export import compile_blocks
from aot.options import Options
from aot.pipeline import load_pipeline
from aot.plans import CUBLASLT_WORKSPACE_SIZE, Trials
from aot.saving import save_and_push, save_packages
from aot.target import Target
from compile import compile_transformer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "assets" / "tiny-flux")
STARTUP_TIMEOUT_S = 240
# float32 on CPU: compiled blocks match eager ones to ~1e-7 relative (measured 4e-7 on the final
# images); 1e-5 leaves room for other CPUs' vector widths, and still fails for any real mistake.
TOLERANCE = 1e-5


def tiny_options(**changes) -> Options:
    return Options(model=TINY, device="cpu", **changes)


def load_tiny():
    return load_pipeline(tiny_options())


def decided(pipe, options: Options) -> tuple:
    """`(pipe, target, trials)`: what compile.py's `compile_transformer` works out once and hands to
    both `export.compile_blocks` and `loading.load_packages`."""
    return pipe, Target.of(pipe, options), Trials.resolve(options, pipe.transformer)


def optimize(pipe, options: Options, compiled=None):
    """What app.py's `start` does for one pipeline: compile (or bind `compiled`, another replica's
    packages), save where asked, apply; returns the report."""
    compiled = compiled or compile_transformer(pipe, options)
    if options.save:
        save_and_push(compiled, options)
    return apply_(pipe, compiled)


def generate(pipe, height: int, width: int, seed: int = 0, steps: int = 2, **kwargs) -> torch.Tensor:
    """Images as a float tensor [batch, 3, height, width] in [0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    return pipe(
        "a red cat on a mat",
        height=height,
        width=width,
        num_inference_steps=steps,
        generator=generator,
        output_type="pt",
        **kwargs,
    ).images


@pytest.fixture(autouse=True)
def no_cublaslt_workspace_setting(monkeypatch):
    """Each test starts and ends without `CUBLASLT_WORKSPACE_SIZE`, which resolving a Hopper plan
    (`plan="9.0"`) sets for the process (`plans.set_cublaslt_workspace`)."""
    monkeypatch.setenv(CUBLASLT_WORKSPACE_SIZE, "")  # recorded as unset: undone at the end
    monkeypatch.delenv(CUBLASLT_WORKSPACE_SIZE)


@pytest.fixture(scope="session")
def compiled():
    """`compile_blocks` on the tiny pipeline: one package per block class."""
    return compile_blocks(*decided(load_tiny(), tiny_options()))


@pytest.fixture(scope="session")
def saved(compiled, tmp_path_factory) -> Path:
    """The session's packages in a folder, as `--save` writes them (`AOT_LOAD` for a Space that
    should not compile at startup). Tests read it; a test that changes a set works on a copy."""
    folder = tmp_path_factory.mktemp("saved") / "packages"
    save_packages(compiled, folder)
    return folder


@pytest.fixture
def eager_pipe():
    return load_tiny()


@pytest.fixture
def compiled_pipe(compiled):
    """A freshly loaded tiny pipeline with the session's packages applied."""
    pipe = load_tiny()
    patch_blocks_(pipe, compiled)
    return pipe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A Space started by `command` in its own process group; `url` once it serves, `log` its output."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path):
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}/"
        env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(self.port), **env}
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, *command],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_until_serving(self) -> "Server":
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while "Running on local URL" not in self.text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{self.log.name}: the app did not start:\n{self.text()[-3000:]}")
            time.sleep(0.5)
        return self

    def wait_until_exit(self) -> int:
        try:
            return self.process.wait(timeout=STARTUP_TIMEOUT_S)
        finally:
            self.stop()

    def stop(self) -> None:
        """End the whole process group: the app and, on ZeroGPU, its workers and the harness."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:  # the group is gone already
            return
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class ZeroGPUSpace(Server):
    """app.py in ZeroGPU mode under `zerogpu_harness.py` (`--cpu`: the worker computes on the CPU);
    `device(path)` calls the harness's device API."""

    def __init__(self, env: dict[str, str], log: Path, *harness_flags: str):
        self.api = f"http://127.0.0.1:{free_port()}"
        flags = ["--port", self.api.rsplit(":", 1)[1], *harness_flags]
        super().__init__(["tools/zerogpu_harness.py", *flags, "app.py"], env, log)

    def device(self, path: str, method: str = "GET") -> dict:
        with urllib.request.urlopen(urllib.request.Request(self.api + path, method=method), timeout=30) as answer:
            return json.loads(answer.read() or b"{}")

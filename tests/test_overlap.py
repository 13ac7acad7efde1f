"""Compiles overlapped (aot/overlap.py): the next job runs while a package's wrapper builds, each job's
result and error stay its own, and nothing is left changed. Real AOTInductor compiles on the CPU, and
real C++ builds of a file named as a package's wrapper is."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch._inductor import config, cpp_builder

from aot.blocks import rel_error
from aot.lowering import compile_package
from aot.overlap import WRAPPER_OBJECT, overlapped
from aot.runner import bind


class Gelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x)) * x.sigmoid()


def compile_and_run(module, x, events, name):
    """A job: export and compile `module`, bind the package to its weights, run it on `x`."""
    events.append((name, "start", time.monotonic(), threading.current_thread().name))
    runner, _ = bind(compile_package(torch.export.export(module, (x,))), module)
    return runner(x)


def test_the_next_compile_runs_during_the_wrapper_build_and_errors_stay_with_their_job(monkeypatch):
    events = []
    real_run = cpp_builder.run_compile_cmd

    def timed_run(cmd_line, cwd):  # a spy: the real build runs; its span is recorded
        start = time.monotonic()
        real_run(cmd_line, cwd)
        if cmd_line.split(" -o ")[-1].split()[0].endswith(WRAPPER_OBJECT):  # the wrapper's compile, not the link
            events.append(("wrapper", "built", (start, time.monotonic()), threading.current_thread().name))

    monkeypatch.setattr(cpp_builder, "run_compile_cmd", timed_run)
    torch.manual_seed(0)
    a, b = Gelu().eval(), Gelu().eval()
    x = torch.randn(4, 32)

    def broken():
        events.append(("broken", "start", time.monotonic(), threading.current_thread().name))
        raise ValueError("job three")

    settings = config.get_config_copy()
    build = cpp_builder.CppBuilder.build
    with (
        torch.no_grad(),
        overlapped(
            [
                lambda: compile_and_run(a, x, events, "a"),
                lambda: compile_and_run(b, x, events, "b"),
                broken,
            ]
        ) as jobs,
    ):
        out_a = jobs[0].result()
        assert [e[0] for e in events if e[1] == "start"] == ["a", "b", "broken"], "each later job ran in a build"
        out_b = jobs[1].result()
        with pytest.raises(ValueError, match="job three"):
            jobs[2].result()
    with torch.no_grad():
        assert rel_error(out_a, a(x)) < 1e-5 and rel_error(out_b, b(x)) < 1e-5

    starts = {name: (t, thread) for name, kind, t, thread in events if kind == "start"}
    builds = [span for _, kind, span, _ in events if kind == "built"]
    assert len(builds) == 2, events
    assert starts["a"][1] == threading.current_thread().name
    assert starts["b"][1] != starts["a"][1] and starts["broken"][1] != starts["a"][1]
    assert abs(starts["b"][0] - builds[0][0]) < 1.0 and starts["b"][0] < builds[0][1], "b began with a's wrapper build"
    assert abs(starts["broken"][0] - builds[1][0]) < 1.0, "the third job began with b's wrapper build"
    assert cpp_builder.CppBuilder.build is build
    # aot_inductor.metadata: Inductor fills that dict in place at every package compile, overlapped or not
    changed = {k for k, v in config.get_config_copy().items() if v != settings[k]} - {"aot_inductor.metadata"}
    assert not changed, f"Inductor's settings changed: {changed}"


def test_jobs_run_once_in_order_and_those_never_asked_for_never_run():
    ran = []

    def job(n):
        def run():
            ran.append(n)
            if n == 1:
                raise RuntimeError("one")
            return n * 10

        return run

    with overlapped([job(0), job(1), job(2), job(3)]) as jobs:
        assert jobs[0].result() == 0 and jobs[0].result() == 0  # no package compiled: nothing ran ahead
        with pytest.raises(RuntimeError, match="one"):
            jobs[1].result()
        with pytest.raises(RuntimeError, match="one"):
            jobs[1].result()  # the same error again, not a second run
        assert jobs[2].result() == 20
    assert ran == [0, 1, 2], "job 3 was never asked for"


def build_wrapper(folder):
    """A real g++ build of a one-line file whose object is named as a package's wrapper object is: what
    `overlapped` runs the next job beside (about 0.1 s)."""
    source = folder / "probe.cpp"
    source.write_text("int probe() { return 1; }\n")
    options = cpp_builder.CppOptions(compile_only=True)
    builder = cpp_builder.CppBuilder(
        name="probe.wrapper", sources=str(source), BuildOption=options, output_dir=str(folder)
    )
    assert builder.get_target_file_path().endswith(WRAPPER_OBJECT)
    builder.build()
    return threading.current_thread().name


def test_a_system_exit_in_a_job_run_during_a_build_is_raised_at_every_result(tmp_path):
    def leave():
        raise SystemExit(f"left on {threading.current_thread().name}")

    with overlapped([lambda: build_wrapper(tmp_path), leave]) as jobs:
        assert jobs[0].result() == threading.current_thread().name
        assert jobs[1].ran, "the second job ran during the build"
        for _ in range(2):
            with pytest.raises(SystemExit, match="left on overlapped-compile"):
                jobs[1].result()


def test_a_job_run_during_a_build_has_its_callers_grad_and_inference_modes(tmp_path):
    def modes():
        return threading.current_thread().name, torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    with torch.inference_mode():
        with overlapped([lambda: build_wrapper(tmp_path), modes, modes]) as jobs:
            jobs[0].result()
            ahead, here = jobs[1].result(), jobs[2].result()
    assert ahead[0] != here[0], "the first ran during the build, the second at its result()"
    assert ahead[1:] == here[1:] == (False, True)
    with torch.no_grad(), overlapped([lambda: build_wrapper(tmp_path), modes]) as jobs:
        jobs[0].result()
        assert jobs[1].result()[1:] == (False, False)


def test_contexts_on_two_threads_closing_out_of_order_leave_the_build_as_it_was(tmp_path):
    build = cpp_builder.CppBuilder.build
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with overlapped([]):
            a_in.set()
            b_in.wait(60)
        a_out.set()

    def thread_b():
        a_in.wait(60)
        with overlapped([lambda: build_wrapper(tmp_path), lambda: threading.current_thread().name]) as jobs:
            b_in.set()
            a_out.wait(60)
            seen["patched after a left"] = cpp_builder.CppBuilder.build is not build
            jobs[0].result()
            seen["second job's thread"] = jobs[1].result()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b, name="b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert seen == {"patched after a left": True, "second job's thread": "overlapped-compile"}
    assert cpp_builder.CppBuilder.build is build


CTRL_C = """
import json, signal, threading, time, pathlib, sys
from torch._inductor import cpp_builder
from aot.overlap import overlapped
sys.path.insert(0, "tests")
from test_overlap import build_wrapper

signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job inherits SIGINT ignored
main, done = threading.main_thread().ident, []
def job():  # Ctrl-C twice at the caller (the second while it waits for this job), then 1 s more work
    for _ in range(2):
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.3)
    time.sleep(1.0)
    done.append(time.monotonic())
build = cpp_builder.CppBuilder.build
try:
    with overlapped([lambda: build_wrapper(pathlib.Path(sys.argv[1])), job]) as jobs:
        jobs[0].result()
except KeyboardInterrupt:
    out = time.monotonic()
print(json.dumps({"job done before the exit": bool(done) and done[0] <= out,
                  "threads left": [t.name for t in threading.enumerate() if t.name == "overlapped-compile"],
                  "build restored": cpp_builder.CppBuilder.build is build}))
"""


def test_ctrl_c_while_a_job_runs_during_a_build_leaves_the_context_once_the_job_ended(tmp_path):
    # A fresh process: Ctrl-C is a signal to the main thread, which pytest-xdist's workers may not be.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "-c", CTRL_C, str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1]) == {
        "job done before the exit": True,
        "threads left": [],
        "build restored": True,
    }

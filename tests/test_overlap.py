"""Compiles overlapped (aot/overlap.py): the next job runs while a package's wrapper builds, each job's
result and error stay its own, and nothing is left changed. Real AOTInductor compiles on the CPU."""

import threading
import time

import pytest
import torch
from torch._inductor import codecache, config, cpp_builder

from aot.blocks import bind, rel_error
from aot.export import compile_package
from aot.overlap import WRAPPER_OBJECT, overlapped


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
    build, compile_ = cpp_builder.CppBuilder.build, codecache.AotCodeCompiler.compile
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
    assert cpp_builder.CppBuilder.build is build and codecache.AotCodeCompiler.compile == compile_
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

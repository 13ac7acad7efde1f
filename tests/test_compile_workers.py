"""Block classes compiled side by side (aot/compile_workers.py): a worker process's package is one
this process would make, and a worker that is gone costs time, not the compile.

`auto` starts workers only where the blocks are on CUDA; here they are started by hand, and a CPU
compile in a worker runs the real worker script (torch, Inductor, the export loaded from disk)."""

import pytest
import torch
from conftest import TOLERANCE, load_tiny

from aot import native
from aot.blocks import bind, rel_error, repeated_blocks
from aot.compile_workers import CompileWorkers, worker_count
from aot.export import capture_blocks

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def programs():
    """The tiny pipeline's first block of each class, its captured inputs, and its export."""
    pipe = load_tiny()
    firsts = {name: found[0] for name, found in repeated_blocks(pipe.transformer).items()}
    (calls,) = capture_blocks(pipe, firsts, [(512, 512)])
    inputs = {name: calls[name][1] for name in firsts}
    with torch.no_grad():
        exported = {name: torch.export.export(block, (), inputs[name]) for name, block in firsts.items()}
    return firsts, inputs, exported


def check_packages(compiled, firsts, inputs):
    assert set(compiled) == set(firsts)
    for name, (package, seconds) in compiled.items():
        assert seconds > 0
        runner, _ = bind(package, firsts[name])
        with torch.no_grad():
            error = rel_error(runner(**inputs[name]), firsts[name](**inputs[name]))
        assert error < TOLERANCE, f"{name}: {error:.1e}"


def test_a_worker_compiles_the_smaller_class_while_this_process_compiles_the_larger(programs):
    firsts, inputs, exported = programs
    sizes = {name: len(program.graph.nodes) for name, program in exported.items()}
    smaller = min(sizes, key=sizes.get)
    with native.compile_scope(CPU), CompileWorkers(1, native.settings(CPU)) as workers:
        compiled = workers.compile(exported)
        process = workers._workers[0]
    assert workers.log == [f"{smaller}: compiled in a worker"], workers.log
    assert process.returncode == 0, "the worker did not end with the jobs"
    check_packages(compiled, firsts, inputs)


def test_a_program_whose_worker_is_gone_compiles_here(programs):
    firsts, inputs, exported = programs
    with native.compile_scope(CPU), CompileWorkers(1, native.settings(CPU)) as workers:
        workers._workers[0].kill()  # as the kernel's OOM killer would
        workers._workers[0].wait()
        compiled = workers.compile(exported)
    assert len(workers.log) == 1 and workers.log[0].endswith(": compiled here (no worker running)"), workers.log
    check_packages(compiled, firsts, inputs)


@pytest.mark.parametrize(
    ("option", "device", "classes", "count"),
    [
        ("auto", "cuda", 2, 1),
        ("auto", "cuda", 3, 2),
        ("auto", "cuda", 1, 0),
        ("auto", "cpu", 2, 0),
        ("off", "cuda", 2, 0),
    ],
)
def test_workers_start_for_each_class_beyond_the_first_on_cuda(option, device, classes, count):
    assert worker_count(option, device, classes) == count

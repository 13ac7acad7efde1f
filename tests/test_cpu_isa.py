"""The CPU ISA rule (blocks.needs_cpu_isa_probe): a CUDA compile starts no probe and picks no vector
ISA, and what a package's native code needs of a CPU is what its fingerprint records."""

import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from io import BytesIO

import pytest
import torch
from conftest import TOLERANCE, load_tiny
from torch._inductor import config

from aot import blocks
from aot.blocks import bind, built_cpu_isa, cpu_isa_scope, needs_cpu_isa_probe, rel_error, repeated_blocks
from aot.export import capture_blocks, compile_package, export_block

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # device objects only: nothing runs on CUDA here
BLOCK = "FluxSingleTransformerBlock"


def test_a_cuda_compile_starts_no_probe_and_builds_no_test_program(tmp_path):
    # A fresh process with its own Inductor cache, as a CUDA Space starts: in this one the probe may
    # have run already, and the probe writes its test programs (.cpp, .so) into that cache.
    script = f"""
import sys, threading, time
sys.path.insert(0, {ROOT!r})
import torch
from torch._inductor import config
from torch._inductor.cpu_vec_isa import InvalidVecISA, pick_vec_isa
from aot import blocks
cuda = torch.device("cuda")
assert not blocks.needs_cpu_isa_probe(cuda)
start = time.perf_counter()
with blocks.cpu_isa_scope(cuda):
    assert config.cpp.vec_isa_ok is False and config.cpp.simdlen == 0
    assert isinstance(pick_vec_isa(), InvalidVecISA), pick_vec_isa()
seconds = time.perf_counter() - start
assert blocks._probe is None, "a probe was started"
assert not [t for t in threading.enumerate() if t.name == "probe-cpu-isa"]
assert config.cpp.vec_isa_ok is None and config.cpp.simdlen is None, "config not restored"
print(f"no probe: {{seconds:.3f}} s")
"""
    cache = tmp_path / "inductor"
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no probe" in done.stdout
    built = [p.name for p in cache.rglob("*") if p.suffix in (".cpp", ".so")] if cache.exists() else []
    assert built == [], f"test programs were built: {built}"


def test_a_cpu_compile_joins_the_probe_with_the_config_as_it_was():
    assert needs_cpu_isa_probe(CPU) and not needs_cpu_isa_probe(CUDA)
    with cpu_isa_scope(CPU):
        assert blocks._probe is not None and not blocks._probe.is_alive(), "the probe was not joined"
        assert config.cpp.vec_isa_ok is None and config.cpp.simdlen is None


def vector_instructions(package: bytes, tmp_path) -> Counter:
    """Instructions of the package's native code (its .so files, disassembled by objdump) by the x86
    extension their registers or encoding need: `avx` (a VEX form, `v...`, of an SSE instruction on
    xmm), `avx2` (ymm; AVX2 is torch's name for the 256-bit level), `avx512` (zmm, mask registers
    k0-k7, or xmm16-31/ymm16-31, which only EVEX encodes)."""
    counts = Counter()
    for name in zipfile.ZipFile(BytesIO(package)).namelist():
        if not name.endswith(".so"):
            continue
        path = tmp_path / "lib.so"
        path.write_bytes(zipfile.ZipFile(BytesIO(package)).read(name))
        listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True)
        for line in listing.stdout.splitlines():
            match = re.match(r"\s*[0-9a-f]+:\t(\S+)\s*(.*)", line)
            if match is None:
                continue
            op, operands = match.groups()
            if re.search(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b", operands):
                counts["avx512"] += 1
            elif "%ymm" in operands:
                counts["avx2"] += 1
            elif op.startswith("v") and "%xmm" in operands:
                counts["avx"] += 1
    return counts


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction classes")
def test_the_recorded_cpu_isa_covers_what_a_package_without_vector_isa_uses(compiled, tmp_path):
    """How "a package saved on one machine loads on another x86-64 CPU" is checked here: it may run
    on any CPU with every extension its fingerprint records (packages.cpu_isa_problem), so the
    record must cover every extension its machine code uses.

    The block is compiled with the CUDA setting forced (test-only: `cpu_isa_scope(cuda)` around a
    CPU block's compile; a real CUDA compile cannot run here) and compared with the session's
    package, built after the probe. Without a vector ISA Inductor's own vector code is gone (fewer
    ymm and zmm instructions where the probe found AVX2), but Inductor still compiles with
    `-march=native`, so gcc may use this CPU's extensions anyway: the record names them
    (`built_cpu_isa`), it does not say "none".
    """
    if shutil.which("objdump") is None:
        pytest.skip("objdump is not installed (apt-get install binutils): the machine code cannot be read")
    pipe = load_tiny()
    block = repeated_blocks(pipe.transformer)[BLOCK][0]
    (calls,) = capture_blocks(pipe, {BLOCK: block}, [(512, 512)])
    kwargs = calls[BLOCK][1]
    exported = export_block(block, kwargs, compiled.packages[BLOCK].contract)
    with cpu_isa_scope(CUDA):
        package = compile_package(exported)
    runner, _ = bind(package, block)
    with torch.no_grad():
        assert rel_error(runner(**kwargs), block(**kwargs)) < TOLERANCE

    used = vector_instructions(package, tmp_path)
    recorded = built_cpu_isa().split()
    assert compiled.fingerprint["cpu_isa"] == " ".join(recorded)
    if used["avx512"]:
        assert "avx512" in recorded, f"{used}, recorded {recorded}"
    if used["avx2"]:
        assert {"avx2", "avx512"} & set(recorded), f"{used}, recorded {recorded}"
    if used["avx"]:
        assert recorded, f"{used}: VEX code needs AVX, recorded nothing"
    if "avx2" in recorded:  # the probe found AVX2 or more: Inductor's vector code uses ymm or zmm
        probed = vector_instructions(compiled.packages[BLOCK].package, tmp_path)
        assert used["avx2"] + used["avx512"] < probed["avx2"] + probed["avx512"], f"{used} vs {probed}"

"""What a package's native code asks of the CPU (aot/portability.py): a CUDA compile starts no probe and
picks no vector ISA, no compile targets more than the x86-64 baseline, and what a package's machine
code needs is what its fingerprint records."""

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

from aot import portability
from aot.blocks import rel_error, repeated_blocks
from aot.export import capture_blocks, export_block
from aot.lowering import compile_package
from aot.runner import bind

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
from torch._inductor.cpu_vec_isa import InvalidVecISA, pick_vec_isa, valid_vec_isa_list
from aot import portability
cuda = torch.device("cuda")
assert not portability.needs_probe(cuda)
with portability.compile_scope(cuda):
    pass  # its header thread runs and is joined: it must not settle the vector ISA for this process
assert valid_vec_isa_list.cache_info().misses == 0, "an empty CUDA scope fixed the vector ISA (torch keeps it)"
start = time.perf_counter()
with portability.compile_scope(cuda):
    assert config.cpp.vec_isa_ok is False and config.cpp.simdlen == 0
    assert isinstance(pick_vec_isa(), InvalidVecISA), pick_vec_isa()
seconds = time.perf_counter() - start
assert portability._probe is None, "a probe was started"
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
    assert portability.needs_probe(CPU) and not portability.needs_probe(CUDA)
    with portability.compile_scope(CPU):
        assert portability._probe is not None and not portability._probe.is_alive(), "the probe was not joined"
        assert config.cpp.vec_isa_ok is None and config.cpp.simdlen is None


def shared_objects(package: bytes, tmp_path):
    """Each .so file in the package's bytes, written in turn to one file under `tmp_path`: its path."""
    archive = zipfile.ZipFile(BytesIO(package))
    for name in archive.namelist():
        if name.endswith(".so"):
            path = tmp_path / "lib.so"
            path.write_bytes(archive.read(name))
            yield path


def vector_instructions(package: bytes, tmp_path) -> Counter:
    """Instructions of the package's native code (its .so files, disassembled by objdump) by the x86
    extension their registers or encoding need: `avx` (a VEX form, `v...`, of an SSE instruction on
    xmm), `avx2` (ymm; AVX2 is torch's name for the 256-bit level), `avx512` (zmm, mask registers
    k0-k7, or xmm16-31/ymm16-31, which only EVEX encodes)."""
    counts = Counter()
    for path in shared_objects(package, tmp_path):
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


X86_LINUX = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64", reason="the portable target is x86-64 Linux's"
)


@X86_LINUX
def test_the_portable_compiler_targets_the_x86_64_baseline_whatever_inductor_asks():
    """gcc's own answer, not an instruction count: the macros it predefines for `-march=native`
    (Inductor's flag) through the wrapper are the baseline's, and the wrapper compiles."""
    compiler = portability.portable_compiler()
    assert compiler is not None and os.access(compiler, os.X_OK)
    assert os.path.basename(compiler) in ("g++", "c++", "clang++") or "g++" in os.path.basename(compiler)

    def macros(cxx):
        done = subprocess.run(
            [cxx, "-march=native", "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return set(re.findall(r"#define (__\w+__) ", done.stdout))

    ours = macros(compiler)
    assert "__SSE2__" in ours and "__x86_64__" in ours
    assert not {m for m in ours if m.startswith(("__AVX", "__SSE4", "__FMA", "__F16C", "__BMI", "__AMX"))}, ours
    theirs = macros(shutil.which(os.path.basename(compiler)) or compiler)
    if "avx2" in torch._inductor.cpu_vec_isa.x86_isa_checker():  # the native target really is wider here
        assert "__AVX2__" in theirs, "this CPU has AVX2 but -march=native does not say so"


def test_the_scope_sets_the_compiler_and_restores_it():
    before = config.cpp.cxx
    with portability.compile_scope(CUDA):
        if portability.portable_compiler() is not None:
            assert config.cpp.cxx == (None, portability.portable_compiler())
    assert config.cpp.cxx == before


@X86_LINUX
def test_a_cuda_package_needs_no_cpu_extension_and_a_cpu_package_records_what_it_uses(compiled, tmp_path):
    """How "a package saved on one machine loads on another x86-64 CPU" is checked here: it may run
    on any CPU with every extension its fingerprint records (portability.isa_problem), so the record must
    cover every extension its machine code uses.

    The block is compiled with the CUDA setting forced (test-only: `compile_scope(cuda)` around a
    CPU block's compile; a real CUDA compile cannot run here): no vector ISA and the portable
    target, so its machine code uses no AVX of any width, and a CUDA compile records "". Before
    the portable target, gcc's `-march=native` put AVX2 (ymm) instructions into the same package on
    this machine (BENCHMARKS.md). The session's package is a CPU compile (after the probe): its
    vector code is the probe's, and its record names at least that.
    """
    if shutil.which("objdump") is None:
        pytest.skip("objdump is not installed (apt-get install binutils): the machine code cannot be read")
    pipe = load_tiny()
    block = repeated_blocks(pipe.transformer)[BLOCK][0]
    (calls,) = capture_blocks(pipe, {BLOCK: block}, [(512, 512)])
    kwargs = calls[BLOCK][1]
    exported = export_block(block, kwargs, compiled.packages[BLOCK].contract)
    with portability.compile_scope(CUDA):
        package = compile_package(exported)
    runner, _ = bind(package, block)
    with torch.no_grad():
        assert rel_error(runner(**kwargs), block(**kwargs)) < TOLERANCE

    used = vector_instructions(package, tmp_path)
    assert used == Counter(), f"a package for CUDA uses {dict(used)}: more than the x86-64 baseline"
    assert portability.isa_built_for(CUDA) == ""

    recorded = portability.isa_built_for(CPU).split()
    assert compiled.fingerprint["cpu_isa"] == " ".join(recorded)
    probed = vector_instructions(compiled.packages[BLOCK].package, tmp_path)
    if probed["avx512"]:
        assert "avx512" in recorded, f"{probed}, recorded {recorded}"
    if probed["avx2"]:
        assert {"avx2", "avx512"} & set(recorded), f"{probed}, recorded {recorded}"
    if probed["avx"]:
        assert recorded, f"{probed}: VEX code needs AVX, recorded nothing"
    if "avx2" in recorded:  # the probe found AVX2 or more: Inductor's vector code uses ymm or zmm
        assert probed["avx2"] + probed["avx512"] > 0, probed


def objdump_versions(package: bytes, prefix: str, tmp_path) -> list[tuple[int, ...]]:
    """The `prefix` symbol versions (e.g. `GLIBC_`) `objdump -T` lists for the package's .so files."""
    found = []
    for path in shared_objects(package, tmp_path):
        symbols = subprocess.run(["objdump", "-T", str(path)], capture_output=True, text=True, check=True)
        found += [tuple(map(int, v.split("."))) for v in re.findall(rf"\({prefix}([\d.]+)\)", symbols.stdout)]
    return found


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the runtime library checks are glibc's and libstdc++'s")
def test_the_recorded_runtimes_are_the_newest_versions_the_packages_link_against(compiled, tmp_path):
    """What `objdump -T` lists as the packages' glibc and libstdc++ symbol versions (a reading
    independent of `portability.runtimes_needed`'s), the newest across the packages, is what the
    fingerprint records; a machine with older libraries refuses them before any load, naming both
    versions, and a malformed record is refused as such."""
    if shutil.which("objdump") is None:
        pytest.skip("objdump is not installed (apt-get install binutils): the symbol versions cannot be read")
    for runtime, prefix in (("glibc", "GLIBC_"), ("glibcxx", "GLIBCXX_")):
        found = [v for p in compiled.packages.values() for v in objdump_versions(p.package, prefix, tmp_path)]
        expected = ".".join(map(str, max(found))) if found else ""
        assert compiled.fingerprint[runtime] == expected, runtime
        assert portability.runtime_problem(runtime, expected) is None  # built here: loads here
    assert compiled.fingerprint["glibc"], "no glibc symbol version found"
    here = platform.libc_ver()[1]
    assert portability.runtime_here("glibc") == here
    assert portability.runtime_problem("glibc", here + ".0") is None  # 2.36.0 is 2.36
    major, minor = map(int, here.split("."))
    newer = f"{major}.{minor + 1}"
    assert portability.runtime_problem("glibc", newer) == (
        f"the packages need glibc {newer} (they were built on a newer system); this machine has {here}"
    )
    assert portability.runtime_problem("glibc", "2.9") is None
    assert portability.runtime_problem("glibc", "2.100") is not None
    assert portability.runtime_problem("glibc", "abc") == "the packages record glibc 'abc', which is not a version"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="libstdc++ as this process loaded it")
def test_this_machines_libstdcxx_is_the_one_this_process_loaded(tmp_path):
    """`runtime_here("glibcxx")` against objdump's list of the version definitions of the
    libstdc++ this process mapped (torch loads it)."""
    if shutil.which("objdump") is None:
        pytest.skip("objdump is not installed (apt-get install binutils)")
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libstdc++.so.6" in line}
    assert paths, "torch loaded no libstdc++"
    defined = set()
    for path in paths:
        listing = subprocess.run(["objdump", "-p", path], capture_output=True, text=True, check=True).stdout
        defined |= {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBCXX_([\d.]+)", listing)}
    assert portability.runtime_here("glibcxx") == ".".join(map(str, max(defined)))


@X86_LINUX
def test_the_compiler_wrapper_is_rewritten_unless_it_is_exactly_ours():
    """A wrapper left at the path with anything else in it (another version's, or planted) is not run."""
    path = portability.portable_compiler()
    ours = open(path).read()
    try:
        with open(path, "w") as f:
            f.write('#!/bin/sh\nexec g++ "$@"\n')  # the portable flags gone
        portability.portable_compiler.cache_clear()
        assert portability.portable_compiler() == path
        assert open(path).read() == ours and " ".join(portability.PORTABLE_FLAGS) in ours
    finally:
        portability.portable_compiler.cache_clear()


@X86_LINUX
def test_no_wrapper_where_its_path_would_make_inductor_read_gcc_as_clang(tmp_path, monkeypatch):
    """Inductor picks the compiler's flag dialect by looking for "clang" anywhere in its path; a
    cache folder whose path names it would give g++ clang's flags. Then packages are built for this
    CPU (-march=native), and a CUDA compile records this CPU's extensions instead of none."""
    from torch._inductor import cpp_builder

    if cpp_builder._is_clang(cpp_builder.get_cpp_compiler()):
        pytest.skip("the compiler here is clang: its path names it anyway")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "clang-builds"))
    portability.portable_compiler.cache_clear()
    try:
        assert portability.portable_compiler() is None
        assert portability.isa_built_for(CUDA) == " ".join(torch._inductor.cpu_vec_isa.x86_isa_checker())
    finally:
        monkeypatch.undo()
        portability.portable_compiler.cache_clear()
    assert portability.portable_compiler() is not None


def test_the_headers_built_ahead_are_the_ones_a_package_compile_uses(tmp_path, monkeypatch):
    """`compile_scope` builds the precompiled headers on a thread while the caller works; a package
    compiled in the scope must find them, not build its own: in a fresh header folder (Inductor's
    `codecache._HEADER_DIR`, pointed at `tmp_path`), the headers there after a CPU compile are
    exactly the ones `precompile_headers` names (a compile that asked for different ones, with other
    flags or another header, leaves more)."""
    from torch._inductor import codecache

    monkeypatch.setattr(codecache, "_HEADER_DIR", str(tmp_path / "headers"))
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", str(tmp_path / "locks"))
    module = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8))
    x = torch.randn(3, 24)
    exported = torch.export.export(module, (x,))
    codecache._precompile_header.cache_clear()  # Inductor keeps each header's path per process
    try:
        with portability.compile_scope(CPU):
            package = compile_package(exported)
            ahead = portability.precompile_headers(CPU)  # built by now: returns their paths at once
    finally:
        codecache._precompile_header.cache_clear()  # later compiles must not get this test's folder
    assert len(ahead) == 2, ahead  # a CPU package: the wrapper's header and the kernels' (cpp_prefix.h)
    built = sorted(str(p) for p in (tmp_path / "headers").rglob("*.gch"))
    assert built == sorted(p + ".gch" for p in ahead), f"the compile built headers of its own: {built}"
    runner, _ = bind(package, module)
    with torch.no_grad():
        assert rel_error(runner(x), module(x)) < TOLERANCE

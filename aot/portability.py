"""What a package's native code asks of the machine it loads on: how it is compiled, what its
fingerprint records, what is checked before a load.

A package holds C++ built by Inductor: for a CPU its kernels, for CUDA the wrapper that launches
the GPU kernels. Three things decide which machines can run it:

* the **vector ISA** (AVX2, AVX-512, ...) Inductor picks for its own vector code, found by torch's
  probe, which builds and loads test programs (tens of seconds per process: BENCHMARKS.md). Only a
  CPU compile needs it (`needs_probe`); a CUDA compile picks none and starts no probe.
* the **target architecture** gcc compiles for. Torch 2.11 builds every package with
  `-march=native` (`cpp_builder._get_optimization_cflags`, no setting turns it off), so a package
  may use any extension of the CPU it was built on, a CUDA wrapper too (AVX-512 on the H200 host,
  BENCHMARKS.md), and then dies with SIGILL on a CPU without it. `compile_scope` compiles through a
  wrapper around the compiler that puts `-march=x86-64 -mtune=generic` last (gcc and clang take the
  last `-march`), so nothing beyond the x86-64 baseline is used unless the vector ISA asks for it.
* the **runtime libraries**: the package links against glibc's (and, for a CPU package's kernels,
  libstdc++'s) versioned symbols as the building machine's headers name them, so a package built
  on a newer system does not load on an older one (built on the H200's Ubuntu 24.04, glibc 2.39, a
  FLUX package needs glibc 2.38 for `__isoc23_strtol`: Debian 12, the base of many Space images, has
  2.36; BENCHMARKS.md). `runtimes_needed` reads what packages need.

`compile_scope` is where packages are compiled; `isa_built_for` and `runtimes_needed` are what their
fingerprint records, and `isa_problem` and `runtime_problem` the checks before a load
(`loading.load_packages`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import io
import logging
import os
import platform
import re
import shlex
import shutil
import tempfile
import threading
import zipfile
from typing import Iterator

import torch

log = logging.getLogger("compile")

# Appended to every C++ compile on x86-64 Linux (the last -march wins): the baseline every x86-64
# CPU runs (SSE2), tuned for none in particular.
PORTABLE_FLAGS = ("-march=x86-64", "-mtune=generic")


def needs_probe(device: torch.device) -> bool:
    """Whether compiling packages for `device` needs torch's CPU vector-ISA probe
    (`probe_in_background`): the one rule, read wherever the probe is started or joined.

    On a CPU the package's kernels are C++, vectorized for the ISA the probe finds. For CUDA the
    package's C++ is the wrapper that launches the GPU kernels, which vector code does not speed
    up, so a CUDA compile skips the probe and its tens of seconds per process (BENCHMARKS.md).
    """
    return device.type != "cuda"


@contextlib.contextmanager
def compile_scope(device: torch.device) -> Iterator[None]:
    """Compile packages for `device` inside this.

    * Vector ISA: after the probe (joined here) where `needs_probe`, else none: Inductor's
      `cpp.vec_isa_ok = False`, under which `cpu_vec_isa.pick_vec_isa` builds no test program, and
      `cpp.simdlen = 0`, so that it picks none also in a process that probed before. Torch keeps
      its answers per process (`valid_vec_isa_list`, each ISA's `__bool__`): where the first is made
      in here, a later CPU compile in this process gets no vector ISA either (a process compiles
      for one device).
    * Target: on x86-64 Linux, Inductor's compiler (`cpp.cxx`) is `portable_compiler()`, so the
      code needs nothing of the CPU beyond the x86-64 baseline and the vector ISA.
    * Precompiled headers: built on a thread from here (`precompile_headers`), while the caller
      captures, exports and lowers, and joined on the way out. Every package's C++ is compiled
      against one (the wrapper's; a CPU package's kernels against a second), which its first
      package otherwise builds in line, before its wrapper (BENCHMARKS.md).
    """
    settings = {}
    if needs_probe(device):
        probe_in_background().join()
    else:
        settings.update({"cpp.vec_isa_ok": False, "cpp.simdlen": 0})
    compiler = portable_compiler()
    if compiler is not None:
        settings["cpp.cxx"] = (None, compiler)
    with torch._inductor.config.patch(settings):
        importlib.import_module("torch._inductor.codecache")  # here: two threads importing one module can deadlock

        headers = threading.Thread(target=precompile_headers, args=(device,), name="precompile-headers", daemon=True)
        headers.start()
        try:
            yield
        finally:
            headers.join()


def precompile_headers(device: torch.device) -> list[str]:
    """Build the precompiled headers that compiling an AOTInductor package for `device` asks for, in
    Inductor's cache, with Inductor's own call and arguments (`AotCodeCompiler.compile` in torch
    2.11's `_inductor/codecache.py`), under the Inductor settings in force (`compile_scope`'s);
    returns their paths (none where `aot_inductor.precompile_headers` is off).

    A package compile then finds them built (Inductor keys a header by its preprocessed text, the
    compiler and the command line, and builds it under a file lock, so a compile that asks while
    this one builds waits for it). Where anything here differs from what the compile asks, the
    compile builds its own header, as it would without this: slower, never wrong. The header is
    built outside `lowering.INDUCTOR_CONFIGS`, which therefore holds no C++ build flag. A failure is
    logged, not raised: the compile meets the same problem and raises it.
    """
    try:
        from torch._inductor import codecache, config  # heavy: at first use
        from torch._inductor.cpp_builder import (  # heavy: at first use
            CppBuilder,
            CppTorchDeviceOptions,
            _set_gpu_runtime_env,
        )
        from torch._inductor.cpu_vec_isa import invalid_vec_isa, pick_vec_isa  # heavy: at first use

        if not config.aot_inductor.precompile_headers or config.aot_inductor.package_cpp_only:
            return []
        _set_gpu_runtime_env()
        # Without the probe, what `pick_vec_isa` answers in `compile_scope`, not asked: torch keeps its
        # first answer per process (`valid_vec_isa_list`), and an empty scope must not decide it.
        vec_isa = pick_vec_isa() if needs_probe(device) else invalid_vec_isa
        device_type = device.type
        command = {
            "aot_mode": True,
            "device_type": device_type,
            "use_mmap_weights": False,  # weights are not in the package (`package_constants_in_so`)
            "use_mmap_weights_external": False,
            "use_relative_path": False,
            "vec_isa": vec_isa,
        }
        options = CppTorchDeviceOptions(vec_isa=vec_isa, device_type=device_type, aot_mode=True)
        command_line = repr(CppBuilder(name="o", sources="i", BuildOption=options).get_command_line())
        wrapper = codecache._get_cpp_wrapper_header(device_type, aot_mode=True)
        built = [codecache._precompile_header(wrapper, command_line, min_optimize=True, **command)]
        if prefix := codecache._get_cpp_prefix_header(device_type):
            built.append(codecache._precompile_header(prefix, command_line, **command))
        return built
    except Exception as exc:  # the package compile builds them itself, and raises what fails there
        log.info("precompiled headers not built ahead (%s); the package compile builds them", type(exc).__name__)
        log.debug("precompiled headers: %s", exc)
        return []


@functools.cache
def portable_compiler() -> str | None:
    """Path of a wrapper around Inductor's C++ compiler that appends `PORTABLE_FLAGS`; None off
    x86-64 Linux (elsewhere torch's own flags stay: other architectures are compared whole by the
    fingerprint's `machine`), and None where the wrapper's path would change how Inductor reads the
    compiler (then packages are built for this CPU, and `isa_built_for` records its extensions).

    The wrapper is a two-line `sh` script in Inductor's own cache folder (per user, where torch keeps
    the code it compiles and loads), in a folder named by a hash of what it runs (so Inductor's caches
    see one compiler per setting), under the compiler's name. Inductor picks its flag dialect from the
    compiler's whole path (`cpp_builder._is_clang` looks for "clang" anywhere in it), so the wrapper
    is used only where that reading of its path is the real compiler's. The script is checked at
    every process's first use and written again (atomically) unless it is exactly this one.

    Raises:
        torch._inductor.exc.InvalidCxxCompiler: no C++ compiler (Inductor's search, `CXX` or `g++`).
    """
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    from torch._inductor import cpp_builder  # heavy: at first use
    from torch._inductor.runtime.cache_dir_utils import (  # heavy: at first use
        cache_dir,
    )

    found = cpp_builder.get_cpp_compiler()  # called before any compile_scope patches it (this is cached)
    compiler = shutil.which(found) or found
    script = (
        "#!/bin/sh\n"
        "# aot/portability.py: Inductor's C++ compiler, with -march=x86-64 last (the last -march wins)\n"
        f'exec {shlex.quote(compiler)} "$@" {" ".join(PORTABLE_FLAGS)}\n'
    )
    digest = hashlib.sha256(script.encode()).hexdigest()[:16]
    folder = os.path.join(cache_dir(), f"aot-cxx-{digest}")
    path = os.path.join(folder, os.path.basename(compiler))
    dialect = (cpp_builder._is_clang(path), cpp_builder._is_gcc(path))
    if dialect != (cpp_builder._is_clang(compiler), cpp_builder._is_gcc(compiler)):
        return None
    try:
        with open(path) as f:
            current = f.read()
    except OSError:
        current = None
    if current != script or not os.access(path, os.X_OK):
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write(script)
        os.chmod(partial, 0o755)
        os.replace(partial, path)
    return path


def isa_built_for(device: torch.device) -> str:
    """The CPU ISA a package compiled for `device` in `compile_scope` needs, as its fingerprint
    records it (`cpu_isa`, checked by `isa_problem`): extensions in torch's names, "" for none.

    * CUDA: "" on x86-64 Linux (`portable_compiler`: the baseline only, no vector ISA).
    * CPU: this CPU's vector extensions (`x86_isa_checker`, which asks the CPU: no test builds),
      e.g. `avx2 avx512 avx512_vnni`: the probe picks the widest of them that builds, and the
      kernels need it.
    """
    from torch._inductor.cpu_vec_isa import (  # heavy: at first use
        x86_isa_checker,
    )

    if not needs_probe(device) and portable_compiler() is not None:
        return ""
    return " ".join(x86_isa_checker())


def isa_problem(cpu_isa: str) -> str | None:
    """Why this CPU cannot run C++ built for `cpu_isa`, or None. `cpu_isa` names vector extensions
    in torch's words: `isa_built_for`'s (e.g. `avx2 avx512 avx512_vnni`; "" for none) or, in older
    packages, the building CPU's or Inductor's vector ISA (e.g. `avx512 avx512_vnni`).

    Torch's own rule for a usable ISA (`cpu_vec_isa.valid_vec_isa_list`): every flag of it is in
    `x86_isa_checker()`, which asks the CPU (under a millisecond; no test builds). Other
    architectures have no finer names than the architecture, which the fingerprint compares.
    """
    from torch._inductor.cpu_vec_isa import (  # heavy: at first use
        x86_isa_checker,
    )

    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    have = x86_isa_checker()
    missing = [flag for flag in cpu_isa.split() if flag not in have]
    if missing:
        return f"the packages were built for CPU ISA {cpu_isa!r}; this CPU lacks {', '.join(missing)}"
    return None


# The versioned runtime libraries a package's shared objects link against: the fingerprint key, the
# prefix of their symbol versions (`GLIBC_2.38`, `GLIBCXX_3.4.30`), and the library's file name.
RUNTIMES = {"glibc": ("GLIBC_", "libc.so.6"), "glibcxx": ("GLIBCXX_", "libstdc++.so.6")}


def runtimes_needed(*packages: bytes) -> dict[str, str]:
    """Per runtime of `RUNTIMES`, the newest symbol version the shared objects in `.pt2` packages'
    bytes link against, across all of them, e.g. `{"glibc": "2.38", "glibcxx": ""}` ("" where they
    name none): what the dynamic loader checks against the machine's libraries before it loads them.

    Read from the version names in the objects' dynamic string tables, without loading them:
    `objdump -T` lists the same.
    """
    objects = []
    for package in packages:
        with zipfile.ZipFile(io.BytesIO(package)) as archive:
            objects += [archive.read(name) for name in archive.namelist() if name.endswith(".so")]
    found = {name: {v for data in objects for v in _versions(prefix, data)} for name, (prefix, _) in RUNTIMES.items()}
    return {name: max(versions, key=version_key, default="") for name, versions in found.items()}


def runtime_here(name: str) -> str:
    """This machine's version of runtime `name` (`RUNTIMES`), "" where it has none: glibc's from
    `confstr` (e.g. "2.36"); libstdc++'s as the newest `GLIBCXX_` version the copy this process
    loaded defines (e.g. "3.4.30"; torch loads it, so it is the one a package would get)."""
    if name == "glibc":
        try:
            return os.confstr("CS_GNU_LIBC_VERSION").split()[-1]  # "glibc 2.36"
        except (ValueError, OSError, AttributeError, IndexError):
            return ""
    prefix, library = RUNTIMES[name]
    try:
        with open("/proc/self/maps") as maps:
            paths = {f.split()[-1] for f in maps if os.path.basename(f.split()[-1]).startswith(library)}  # .so.6.0.30
    except OSError:
        return ""
    versions = set()
    for path in paths:
        with open(path, "rb") as f:
            versions.update(_versions(prefix, f.read()))
    return max(versions, key=version_key, default="")


def _versions(prefix: str, data: bytes) -> set[str]:
    """The versions named `{prefix}{version}` in a shared object's bytes (`GLIBC_2.38` -> "2.38")."""
    return {v.decode() for v in re.findall(re.escape(prefix.encode()) + rb"(\d+(?:\.\d+)+)", data)}


def runtime_problem(name: str, needed: str) -> str | None:
    """Why this machine cannot load packages that need version `needed` of runtime `name`
    (`runtimes_needed`; "" for none), or None."""
    if not needed:
        return None
    try:
        wanted = version_key(needed)
    except ValueError:
        return f"the packages record {name} {needed!r}, which is not a version"
    here = runtime_here(name)
    if not here:
        return f"the packages need {name} {needed}; this machine has none"
    if version_key(here) < wanted:
        return f"the packages need {name} {needed} (they were built on a newer system); this machine has {here}"
    return None


def version_key(text: str) -> tuple[int, ...]:
    """ "2.38" -> (2, 38), without trailing zeros ("2.36.0" and "2.36" are the same version).

    Raises:
        ValueError: `text` is not dot-separated whole numbers.
    """
    if not re.fullmatch(r"\d+(\.\d+)*", text):
        raise ValueError(f"{text!r} is not a version")
    parts = [int(part) for part in text.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def probe_in_background() -> threading.Thread:
    """Start torch's CPU vector-ISA probe on a thread (once per process); returns it.

    A compile for a CPU needs it (`needs_probe`): Inductor picks the package's vector flags with it
    (`cpu_vec_isa.pick_vec_isa`). Torch finds the ISA by building and loading test programs, each
    load in a child Python (see BENCHMARKS.md), so `load_pipeline` starts it beside loading the
    weights when it will compile for a CPU; `compile_scope` joins it. Loading a package does not
    need it (`runner.load_runner`).
    """
    from torch._inductor.cpu_vec_isa import (  # heavy: at first use
        valid_vec_isa_list,
    )

    global _probe
    if _probe is None:
        _probe = threading.Thread(target=valid_vec_isa_list, name="probe-cpu-isa", daemon=True)
        _probe.start()
    return _probe


_probe: threading.Thread | None = None

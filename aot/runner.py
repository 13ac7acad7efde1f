"""Compiled blocks at run time: a package loaded once per block class and bound to every block.

A package is weights-less: it is loaded once per block class (`SharedPackage`), and each block
(`CompiledBlock`) runs it on its own tensors, bound with `load_constants(user_managed=True)`, so the
transformer keeps one copy of its weights. Every call is checked against the package's `Contract`
first (contract.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

# The runner's Python wrapper, imported with this module, not at a package's first load: on ZeroGPU
# that load runs in every new worker, which would import it (torch.export's archive and serde
# modules, about 0.1 s: BENCHMARKS.md) each time; imported here, workers inherit it through fork.
from torch._inductor.package import AOTICompiledModel

from aot import locks
from aot.blocks import block_constants, forward_signature
from aot.compiled import BlockPackage
from aot.costs import COSTS
from aot.fa3 import load_fa3


def load_runner(package: bytes) -> Any:
    """Load the AOTInductor model in a `.pt2` package's bytes; returns the runner.

    The runner is single-threaded: no locks or CUDA event queries per call, so a step can be
    captured into a CUDA graph (graphs.py); one call at a time per block, as in a diffusion loop.

    This is the loader `torch._inductor.aoti_load_package` wraps (`AOTIModelPackageLoader`, as its
    own fallback calls it) without the device-information check in front of it: that check only
    warns on a mismatch, and it runs the CPU ISA probe (`portability.probe_in_background`), which takes
    far longer than the load (see BENCHMARKS.md). Packages are checked before they get here
    instead (`loading.load_packages`): the CPU architecture, CUDA and compute capability must
    match, and this machine must have every vector extension and runtime library version the
    packages record (portability.py); a set that fails is refused, not warned about.

    The loader extracts the package into a new folder `/tmp/<random>/` (whatever TMPDIR says; torch
    2.11) and removes it when the runner is freed, which a killed process never does, and ZeroGPU
    kills its workers. So this process holds a lock on an owner mark in each folder it extracted
    (`locks.hold`: the kernel drops it when the process dies, whatever its PID), and the first load
    of a process removes the folders whose mark nobody holds (`remove_stale_extractions`).

    Raises:
        RuntimeError: the native loader cannot read the package.
    """
    global _swept
    if not _swept:
        remove_stale_extractions()
        _swept = True
    with tempfile.NamedTemporaryFile(suffix=".pt2") as f:  # the loader reads a path; it extracts at once
        f.write(package)
        f.flush()
        loader = torch._C._aoti.AOTIModelPackageLoader(f.name, "model", True, 1, -1)
    for folder in _mapped_extractions():
        locks.hold(folder / OWNER_MARK)
    return AOTICompiledModel(loader)


# Where AOTIModelPackageLoader extracts packages, and the lock file its loading process holds there.
EXTRACT_ROOT = Path("/tmp")
OWNER_MARK = ".aot-blocks-owner.lock"
_swept = False


def _mapped_extractions() -> set[Path]:
    """The `/tmp/<random>` folders of the AOTI libraries this process has loaded (/proc/self/maps)."""
    folders = set()
    with open("/proc/self/maps") as maps:
        for line in maps:  # address, perms, offset, device, inode, path; plain string tests
            if not line.endswith(".so\n") or "/aotinductor/" not in line:
                continue
            path = Path(line.split(maxsplit=5)[-1].strip())
            if path.parts[:2] == EXTRACT_ROOT.parts and len(path.parts) > 3:
                folders.add(EXTRACT_ROOT / path.parts[2])
    return folders


def remove_stale_extractions() -> list[Path]:
    """Remove the package folders under /tmp that processes no longer alive extracted; returns them.

    Only folders marked by `load_runner` (`/tmp/<random>/.aot-blocks-owner.lock`) are candidates;
    those whose mark a living process holds stay (`locks.held`). A process killed between
    extracting and marking (microseconds) leaves an unmarked folder, which stays.
    """
    removed = []
    for mark in _owner_marks():
        if not locks.held(mark):
            shutil.rmtree(mark.parent, ignore_errors=True)
            removed.append(mark.parent)
    return removed


def _owner_marks() -> list[Path]:
    """The owner marks under /tmp's folders. Other processes (another worker sweeping, any program
    cleaning its temporary folder) remove folders while this looks: a folder gone is skipped
    (`Path.glob` raised FileNotFoundError on one that vanished between listing and reading it)."""
    marks = []
    with os.scandir(EXTRACT_ROOT) as entries:
        folders = [entry.path for entry in entries if entry.is_dir(follow_symlinks=False)]
    for folder in folders:
        try:
            with os.scandir(folder) as entries:
                marks += [Path(entry.path) for entry in entries if entry.name == OWNER_MARK]
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
    return marks


def bind(package: bytes, block: torch.nn.Module) -> tuple[Any, dict[str, torch.Tensor]]:
    """Load a weights-less package and bind it to `block`'s own tensors (no copy).

    Returns the runner (call it like the block's forward) and the constants it is bound to, by
    the package's names.
    """
    runner = load_runner(package)
    constants = bound_constants(runner.get_constant_fqns(), block)
    runner.load_constants(constants, check_full_update=True, user_managed=True)
    return runner, constants


def bound_constants(names: list[str], block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`block`'s tensors under the package's constant `names` (`block_constants`)."""
    available = block_constants(block)
    return {name: available[name] for name in names}


class SharedPackage:
    """One block class's package, loaded once per process and run by every block of the class.

    A weights-less package reads its weights through pointers set by `load_constants`; a call from
    another block than the previous one sets that block's pointers first (user-managed: no copy),
    as `spaces.aoti_blocks_load` does. So a new ZeroGPU worker extracts and loads one package per
    class, not one per block (FLUX.1-dev: 2 instead of 57), and a CUDA graph captured over the
    step records each block's kernels with that block's pointers, so a replay rebinds nothing.
    Loads and binds are counted in `COSTS`.

    Raises:
        ImportError, OSError, RuntimeError: `fa3_kernel` (the FA3 kernel the package calls) cannot be
            loaded (`load_fa3`).
    """

    def __init__(self, package: BlockPackage, fa3_kernel: str | None = None):
        if fa3_kernel is not None:  # the package calls the FA3 op: register its kernel now, where the
            load_fa3(fa3_kernel)  # package is applied (no GPU work): ZeroGPU workers inherit it
        self.package = package
        self.runner: Any = None
        self.names: list[str] = []
        self.bound_to: object = None
        self._lock = threading.Lock()

    def load(self) -> None:
        """Load the package, once; on ZeroGPU, in the worker."""
        with self._lock:
            if self.runner is None:
                start = time.perf_counter()
                self.runner = load_runner(self.package.package)
                self.names = self.runner.get_constant_fqns()
                COSTS.add("load", time.perf_counter() - start)

    def run(self, owner: object, constants: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> Any:
        """Run the package on `owner`'s `constants` (bound here unless `owner` ran last)."""
        if self.bound_to is not owner:
            start = time.perf_counter()
            self.runner.load_constants(constants, check_full_update=True, user_managed=True)
            self.bound_to = owner
            COSTS.add("bind", time.perf_counter() - start)
        return self.runner(**kwargs)


class CompiledBlock:
    """Replaces one block's `forward`: checks the inputs, then runs its class's `SharedPackage` on
    this block's own tensors (found once, at the block's first call: on ZeroGPU inside the worker,
    after the weights moved to the GPU)."""

    def __init__(self, block: torch.nn.Module, shared: SharedPackage):
        self.block, self.shared, self.package = block, shared, shared.package
        self._signature = forward_signature(block)
        self._constants: dict[str, torch.Tensor] | None = None
        self._bound: list[tuple[dict[str, Any], str, Any, str]] = []

    @property
    def loaded(self) -> bool:
        """Whether this block has run its package (in this process)."""
        return self._constants is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = dict(self._signature.bind(*args, **kwargs).arguments)
        self.package.contract.check_inputs(kwargs)
        if self._constants is None:
            self.shared.load()
            self._constants = bound_constants(self.shared.names, self.block)
            self._bound = _members(self.block)
        return self.shared.run(self, self._constants, kwargs)

    def check_bound(self, index: int) -> None:
        """Raise `RuntimeError` if a submodule, parameter or buffer of the block was replaced since
        the package was bound: the package would go on running the old tensors (a silent no-op).
        Changes in place (`weight.data.copy_(...)`, `load_state_dict`) are what it runs, and pass."""
        for members, key, value, name in self._bound:
            if members.get(key) is not value:
                raise RuntimeError(
                    f"compiled block #{index} ({self.package.block}): {name} was replaced after its package was "
                    "bound to the old one, which it would go on running. Change weights in place (tensor.copy_, "
                    "load_state_dict), or use LoRAs through --lora / --lora-choices (lora.py)."
                )


def _members(module: torch.nn.Module) -> list[tuple[dict[str, Any], str, Any, str]]:
    """(the dict holding it, its key there, the object, its name in `module`) for every submodule,
    parameter and buffer under `module`."""
    found = []
    for prefix, sub in module.named_modules():
        for members in (sub._modules, sub._parameters, sub._buffers):
            found += [(members, key, value, f"{prefix}.{key}".lstrip(".")) for key, value in members.items()]
    return found


class BindingCheck:
    """A forward pre-hook for the transformer (`patch_blocks_` registers it): `CompiledBlock.check_bound` for
    every compiled block before each step, since a CUDA graph replay calls no block's forward.
    (FLUX.1-dev: 57 blocks, about 2,400 identity tests a step.)"""

    def __init__(self, blocks: list[CompiledBlock]):
        self.blocks = blocks

    def __call__(self, transformer: torch.nn.Module, args: Any) -> None:
        for index, block in enumerate(self.blocks):
            block.check_bound(index)


def check_constants(block: torch.nn.Module, package: BlockPackage, index: int) -> None:
    """Raise `ValueError` unless `block` holds every constant the package needs, same shape and dtype.

    Catches a package applied to other weights (another model's blocks, other shapes or dtypes,
    FP8 on one side only) before any call, instead of a crash inside the package (a weights-less
    package reads whatever memory it is bound to).
    """
    have = block_constants(block)
    missing = sorted(set(package.constants) - set(have))
    wrong = [
        f"{name} {tuple(have[name].shape)} {have[name].dtype} (package: {shape} {dtype})"
        for name, (shape, dtype) in package.constants.items()
        if name in have and (tuple(have[name].shape) != shape or have[name].dtype != dtype)
    ]
    if missing or wrong:
        raise ValueError(
            f"{package.block} #{index} does not match its compiled package: "
            f"missing constants {missing[:5]}{'...' if len(missing) > 5 else ''}; mismatched {wrong[:5]}"
        )


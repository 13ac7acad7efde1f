"""Compiled blocks at run time: the input contract, the package, and binding it to every block.

A package is weights-less: it is loaded once per block class (`SharedPackage`), and each block
(`CompiledBlock`) runs it on its own tensors, bound with `load_constants(user_managed=True)`, so the
transformer keeps one copy of its weights.
AOTInductor checks no input shapes, so every call is checked against the `Contract` first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

# The runner's Python wrapper, imported with this module, not at a package's first load: on ZeroGPU
# that load runs in every new worker, which would import it (torch.export's archive and serde
# modules, about 0.1 s: BENCHMARKS.md) each time; imported here, workers inherit it through fork.
from torch._inductor.package import AOTICompiledModel
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from aot import locks, zerogpu
from aot.fast_paths import Decision, fp8_config, load_fa3, quantize_block_
from aot.options import Resolution

Call = tuple[tuple[Any, ...], dict[str, Any]]


def forward_signature(module: torch.nn.Module) -> inspect.Signature:
    """The signature of the class's own `forward`, without `self` (also once `forward` is patched)."""
    signature = inspect.signature(type(module).forward)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def patch_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> None:
    """Make `forward` what calling `module` runs: an instance attribute, in front of the class's own
    `forward` (still `type(module).forward`, for the signature and the eager step)."""
    module.forward = forward


def patched_forward(module: torch.nn.Module, kind: type = object) -> Any:
    """The forward `patch_forward` put on `module`, if it is a `kind`; else None."""
    patch = module.__dict__.get("forward")
    return patch if isinstance(patch, kind) else None


def unpatch_forward(module: torch.nn.Module, kind: type = object) -> Any:
    """Undo `patch_forward` where its patch is a `kind`: the class's `forward` runs again. Returns
    the patch removed, or None."""
    patch = patched_forward(module, kind)
    if patch is not None:
        del module.forward
    return patch


@dataclass(frozen=True)
class TensorSpec:
    """What a compiled block accepts for one tensor input: shape with dynamic dims, dtype, device.

    A dynamic dim (None in `shape`) is `image[d] * I + text[d] * L + offsets[d]`, where I is the
    image tokens of the sequence the block sees (the output's, plus a reference image's for edit
    families) and L the text tokens (where the text length follows the prompt). `image[d]` and
    `text[d]` are whole numbers >= 0, at least one of them positive.
    """

    path: str
    shape: tuple[int | None, ...]
    offsets: tuple[int, ...]
    image: tuple[int, ...]
    text: tuple[int, ...]
    dtype: torch.dtype
    device: str

    def form(self, dim: int) -> tuple[int, int]:
        """(image, text) coefficients of dim `dim`: (0, 0) for a fixed dim."""
        return self.image[dim], self.text[dim]


@dataclass(frozen=True)
class Contract:
    """The inputs a package accepts; checked before every compiled call (AOTI itself checks none).

    `image_range` and `text_range` are the (min, max) of I and L (`TensorSpec`) the package was
    exported for: `families.Family.image_range` and `text_range`.
    """

    block: str
    tree: pytree.TreeSpec  # structure of the kwargs, non-tensor values included
    tensors: tuple[TensorSpec, ...]
    constants: tuple[Any, ...]  # captured non-tensor leaves; must be equal at every call
    resolution: Resolution
    image_range: tuple[int, int]
    text_range: tuple[int, int] | None = None  # None: the text length is a constant of the package

    def form_range(self, form: tuple[int, int]) -> tuple[int, int]:
        """(min, max) of `a * I + b * L` for form (a, b) over the package's ranges."""
        (a, b), text = form, self.text_range or (0, 0)
        return a * self.image_range[0] + b * text[0], a * self.image_range[1] + b * text[1]

    def to_json(self) -> dict[str, Any]:
        """A JSON-able description (for `packages.save_packages`); the resolution is stored beside it."""
        return {
            "tree": pytree.treespec_dumps(self.tree),
            "tensors": [
                {
                    "path": t.path,
                    "shape": list(t.shape),
                    "offsets": list(t.offsets),
                    "image": list(t.image),
                    "text": list(t.text),
                    "dtype": dtype_name(t.dtype),
                    "device": t.device,
                }
                for t in self.tensors
            ],
            "constants": list(self.constants),
            "image_range": list(self.image_range),
            "text_range": list(self.text_range) if self.text_range else None,
        }

    @classmethod
    def from_json(cls, block: str, data: dict[str, Any], resolution: Resolution) -> Contract:
        tensors = tuple(
            TensorSpec(
                t["path"],
                tuple(t["shape"]),
                tuple(t["offsets"]),
                tuple(t["image"]),
                tuple(t["text"]),
                parse_dtype(t["dtype"]),
                t["device"],
            )
            for t in data["tensors"]
        )
        text_range = tuple(data["text_range"]) if data.get("text_range") else None
        tree = pytree.treespec_loads(data["tree"])
        return cls(block, tree, tensors, tuple(data["constants"]), resolution, tuple(data["image_range"]), text_range)

    def check(self, kwargs: dict[str, Any]) -> None:
        """Raise `ValueError` naming what differs from the compiled inputs."""
        leaves, tree = pytree.tree_flatten(kwargs)
        if tree != self.tree:
            raise ValueError(f"{self.block} was compiled for inputs {self.tree}; got {tree}")
        tensors = iter(self.tensors)
        constants = iter(self.constants)
        seen: dict[tuple[int, int], int] = {}  # form -> its value a * I + b * L in this call
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                expected = next(constants)
                if leaf != expected:
                    raise ValueError(f"{self.block} was compiled with the value {expected!r}; got {leaf!r}")
                continue
            spec = next(tensors)
            if leaf.dtype != spec.dtype or leaf.device.type != spec.device or leaf.dim() != len(spec.shape):
                raise ValueError(
                    f"{self.block}: {spec.path} must be a {len(spec.shape)}-d {spec.dtype} tensor on "
                    f"{spec.device}; got {leaf.dim()}-d {leaf.dtype} on {leaf.device.type}"
                )
            for dim, (want, have) in enumerate(zip(spec.shape, leaf.shape, strict=True)):
                if want is None:
                    self._check_dynamic(spec, dim, have - spec.offsets[dim], tuple(leaf.shape), seen)
                elif want != have:
                    raise ValueError(
                        f"{self.block} was compiled for {spec.path} of shape {_shape_str(spec)}; "
                        f"got {tuple(leaf.shape)} (batch size and text length are fixed at compile time)"
                    )
        image, text = seen.get((1, 0)), seen.get((0, 1))
        for (a, b), value in seen.items():
            if image is not None and text is not None and value != a * image + b * text:
                raise ValueError(
                    f"{self.block}: a dim of {a}*I + {b}*L is {value}, but I = {image} and L = {text} in this call"
                )

    def _check_dynamic(
        self, spec: TensorSpec, dim: int, value: int, shape: tuple[int, ...], seen: dict[tuple[int, int], int]
    ) -> None:
        a, b = spec.form(dim)
        if a and b:
            form, symbol, rest = (a, b), value, 0
        else:
            form = (1, 0) if a else (0, 1)
            symbol, rest = divmod(value, a or b)
        lo, hi = self.form_range(form)
        if rest or seen.setdefault(form, symbol) != symbol or not lo <= symbol <= hi:
            if form == (1, 0):
                unit, what = "image tokens", self.resolution.describe()
                if (lo, hi) != self.resolution.token_range:
                    what = f"{lo}..{hi} image tokens in the sequence: outputs of {what}, with their references"
            elif form == (0, 1):
                unit, what = "text tokens", f"{lo}..{hi} text tokens"
            else:
                unit, what = "tokens", f"{lo}..{hi} tokens = {a}*image + {b}*text"
            got = f"{value / (a or b):g} {unit}" if rest else f"{symbol} {unit}"
            if not rest and lo <= symbol <= hi:
                got += f" while other inputs of this call have {seen[form]}"
            raise ValueError(f"{self.block} was compiled for {what}; {spec.path} has {got} (shape {shape})")


def _shape_str(spec: TensorSpec) -> str:
    dims = []
    for d, (size, off) in enumerate(zip(spec.shape, spec.offsets, strict=True)):
        if size is not None:
            dims.append(str(size))
            continue
        terms = [f"{c}{symbol}" if c != 1 else symbol for c, symbol in zip(spec.form(d), "IL", strict=True) if c]
        dims.append(" + ".join(terms + ([str(off)] if off else [])))
    return "[" + ", ".join(dims) + "], I = image tokens, L = text tokens"


def contract_from_captures(
    block: str,
    calls: list[Call],
    points: list[tuple[int, int]],
    resolution: Resolution,
    image_range: tuple[int, int],
    text_range: tuple[int, int] | None = None,
) -> Contract:
    """Solve every input dimension as `a * I + b * L + c` from captures at known token counts.

    `points[i]` is (I, L) of `calls[i]`: image tokens of the sequence and text tokens. Calls 0 and
    1 differ in I only; a call 2, where the text length follows the prompt, differs from call 0 in
    L only (`export.compile_blocks` captures so). A dim whose change is not a whole multiple of
    the change in I (or L) cannot be one dynamic dimension: refused. Examples: `image_rotary_emb`
    covers text + image tokens (a = 1, c = FLUX's fixed text length); Z-Image's main blocks see
    image and text tokens in one sequence (a = b = 1). Every other dim is fixed.

    Raises:
        ValueError: the captures differ in structure, or in a dim the rule cannot describe.
    """
    flat = [pytree.tree_flatten_with_path(kwargs) for _, kwargs in calls]
    tree = flat[0][1]
    if any(other != tree for _, other in flat[1:]):
        raise ValueError(f"{block}: inputs differ in structure between captures: {[t for _, t in flat]}")
    (i0, l0), (i1, _) = points[:2]
    if i0 == i1 or points[1][1] != l0 or len(points) > 2 and (points[2][1] == l0 or points[2][0] != i0):
        raise ValueError(
            f"{block}: the captures must differ in image tokens only, then in text tokens only: (I, L) = {points}"
        )
    specs, constants = [], []
    for leaves in zip(*(leaves for leaves, _ in flat), strict=True):
        name = _path_name(leaves[0][0])
        values = [leaf for _, leaf in leaves]
        if not isinstance(values[0], torch.Tensor):
            constants.append(values[0])
            continue
        shape, offsets, image, text = [], [], [], []
        for dim, sizes in enumerate(zip(*(v.shape for v in values), strict=True)):
            a, rest_a = divmod(sizes[0] - sizes[1], i0 - i1)
            b, rest_b = divmod(sizes[2] - sizes[0], points[2][1] - l0) if len(sizes) > 2 else (0, 0)
            if rest_a or a < 0:
                raise ValueError(
                    f"{block}: {name} dim {dim} is {sizes[0]} at {i0} image tokens and {sizes[1]} at {i1}: "
                    "not a whole multiple of the image tokens plus a constant, so one dynamic graph cannot serve both"
                )
            if rest_b or b < 0:
                raise ValueError(
                    f"{block}: {name} dim {dim} is {sizes[0]} at {l0} text tokens and {sizes[2]} at "
                    f"{points[2][1]}: not a whole multiple of the text tokens plus a constant"
                )
            shape.append(None if a or b else sizes[0])
            offsets.append(sizes[0] - a * i0 - b * l0 if a or b else 0)
            image.append(a)
            text.append(b)
        specs.append(
            TensorSpec(
                name, tuple(shape), tuple(offsets), tuple(image), tuple(text), values[0].dtype, values[0].device.type
            )
        )
    text_range = text_range if any(any(s.text) for s in specs) else None
    return Contract(block, tree, tuple(specs), tuple(constants), resolution, image_range, text_range)


def _path_name(path: tuple) -> str:
    """`image_rotary_emb[0]` for the pytree path ('image_rotary_emb', 0)."""
    name = pytree.keystr(path)  # "['image_rotary_emb'][0]"
    return name.replace("['", ".").replace("']", "").lstrip(".")


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """`tensor`, or a tensor subclass's plain inner tensors, depth-first in `__tensor_flatten__`
    order (torchao's FP8 weight: its float8 data, then its scales)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    return [leaf for attr in tensor.__tensor_flatten__()[0] for leaf in plain_tensors(getattr(tensor, attr))]


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters and buffers, each object once (tied weights count once), a
    tensor subclass by its inner tensors (`plain_tensors`)."""
    tensors = [t for p in [*module.parameters(), *module.buffers()] for t in plain_tensors(p)]
    return sum(t.numel() * t.element_size() for t in tensors)


def block_constants(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The block's parameters and persistent buffers under the names a package uses for its constants.

    Tensor-subclass weights (torchao quantization) are exported as their inner tensors under
    `<module>.parametrizations.<name>.original<i>`, `i` counting the plain tensors of the subclass
    depth-first in `__tensor_flatten__` order: the names torch's `unwrap_tensor_subclass_parameters`
    gives (a test checks they agree). Returns the block's own tensors: nothing is copied, and
    `block` is untouched (torch's function registers a parametrization per weight: milliseconds a
    block, which a new ZeroGPU worker would pay for every block).
    """
    constants = {}
    for prefix, module in block.named_modules():
        persistent = [(n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for name, tensor in [*module._parameters.items(), *persistent]:
            if tensor is None:
                continue
            path = f"{prefix}.{name}" if prefix else name
            if is_traceable_wrapper_subclass(tensor):
                where = f"{prefix}.parametrizations.{name}" if prefix else f"parametrizations.{name}"
                constants.update((f"{where}.original{i}", t) for i, t in enumerate(plain_tensors(tensor)))
            else:
                constants[path] = tensor
    return constants


@dataclass
class BlockPackage:
    """A compiled block class: the package bytes and what it needs at run time. Picklable."""

    block: str
    package: bytes
    contract: Contract
    constants: dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype)
    fp8: str | None  # the FP8 granularity its linear layers were quantized at ("row", "tensor"), or None
    export_s: float
    compile_s: float
    rel_error: float

    def metadata(self) -> dict[str, Any]:
        """Everything but the bytes, JSON-able, with the bytes' size and SHA-256 to verify them."""
        return {
            "contract": self.contract.to_json(),
            "constants": {name: [list(shape), dtype_name(dtype)] for name, (shape, dtype) in self.constants.items()},
            "fp8": self.fp8,
            "export_s": self.export_s,
            "compile_s": self.compile_s,
            "rel_error": self.rel_error,
            "bytes": len(self.package),
            "sha256": hashlib.sha256(self.package).hexdigest(),
        }

    @classmethod
    def from_metadata(cls, block: str, package: bytes, meta: dict[str, Any], resolution: Resolution) -> BlockPackage:
        constants = {name: (tuple(shape), parse_dtype(dtype)) for name, (shape, dtype) in meta["constants"].items()}
        contract = Contract.from_json(block, meta["contract"], resolution)
        timings = meta["export_s"], meta["compile_s"], meta["rel_error"]
        return cls(block, package, contract, constants, meta["fp8"], *timings)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The dtype `dtype_name` wrote as `name`. Raises `ValueError` for any other name (it comes from a file)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def load_runner(package: bytes) -> Any:
    """Load the AOTInductor model in a `.pt2` package's bytes; returns the runner.

    The runner is single-threaded: no locks or CUDA event queries per call, so a step can be
    captured into a CUDA graph (graphs.py); one call at a time per block, as in a diffusion loop.

    This is the loader `torch._inductor.aoti_load_package` wraps (`AOTIModelPackageLoader`, as its
    own fallback calls it) without the device-information check in front of it: that check only
    warns on a mismatch, and it runs the CPU ISA probe (`native.probe_in_background`), which takes
    far longer than the load (see BENCHMARKS.md). Packages are checked before they get here
    instead (`packages.load_packages`): the CPU architecture, CUDA and compute capability must
    match, and this machine must have every vector extension and runtime library version the
    packages record (native.py); a set that fails is refused, not warned about.

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


@dataclass
class Costs:
    """What this process has spent on work only compiled blocks do: package loads, binds (a block's
    pointers set before it runs), CUDA graph captures and their check replays (graphs.py), counts
    and seconds. A new ZeroGPU worker pays them once; its `zerogpu-call` lines say what each call spent."""

    loads: int = 0
    load_s: float = 0.0
    binds: int = 0
    bind_s: float = 0.0
    captures: int = 0
    capture_s: float = 0.0
    checks: int = 0
    check_s: float = 0.0

    def add(self, what: str, seconds: float) -> None:
        setattr(self, f"{what}s", getattr(self, f"{what}s") + 1)
        setattr(self, f"{what}_s", getattr(self, f"{what}_s") + seconds)


COSTS = Costs()
zerogpu.count_per_call("compiled blocks", lambda: dataclasses.asdict(COSTS))


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
        self.package.contract.check(kwargs)
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


def repeated_blocks(transformer: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """The transformer's repeated blocks, one group per block class, container and weight layout.

    Classes come from `transformer._repeated_blocks`. A package is bound to the weights of every
    block in its group and compiled for the inputs of the group's first block, so blocks of one
    class are grouped apart where they sit in different containers (Z-Image's `noise_refiner`,
    `context_refiner` and `layers` see image, text, and image + text sequences) or differ in weight
    names or shapes (its context refiner has no modulation weights). A group is named by its class
    when the class has one group, else `<class>-<container>`, with `-<i>` where a container holds
    several layouts (the container's path keeps its dots: names stay apart as paths do).

    Raises:
        ValueError: the attribute is missing, or a listed class has no instance in the model.
    """
    names = getattr(transformer, "_repeated_blocks", None)
    if not names:
        raise ValueError(
            f"{type(transformer).__name__} has no `_repeated_blocks`: regional compilation needs the "
            "list of repeated block class names (diffusers sets it on FluxTransformer2DModel)"
        )
    found: dict[str, dict[tuple, list[torch.nn.Module]]] = {name: {} for name in names}
    for path, module in transformer.named_modules():
        if type(module).__name__ in found:
            container = path.rpartition(".")[0]
            layout = tuple((n, tuple(t.shape)) for n, t in module.state_dict(keep_vars=True).items())
            found[type(module).__name__].setdefault((container, layout), []).append(module)
    empty = [name for name, groups in found.items() if not groups]
    if empty:
        raise ValueError(
            f"{type(transformer).__name__}._repeated_blocks lists {', '.join(empty)}, "
            "but the model has no block of that class"
        )
    named = {}
    for name, groups in found.items():
        for (container, layout), blocks in groups.items():
            if len(groups) == 1:
                named[name] = blocks
                continue
            layouts = [key for key in groups if key[0] == container]
            suffix = f"-{layouts.index((container, layout)) + 1}" if len(layouts) > 1 else ""
            named[f"{name}-{container or '<transformer>'}{suffix}"] = blocks
    return named


@dataclass
class Compiled:
    """What `compile_blocks` returns: one package per block class plus the decisions. Picklable."""

    packages: dict[str, BlockPackage]
    decisions: list[Decision]
    resolution: Resolution
    fa3_kernel: str | None
    fp8_granularity: str | None  # of the FP8 packages; None where every package is bf16
    fingerprint: dict[str, Any]  # what the packages are valid for (`packages.fingerprint`)
    source: str = "compiled"  # or "loaded from <folder or repo>"
    text_fp8: Any = None  # the text encoders' FP8 trial in the same GPU call (`text_fp8.TextFP8`), not saved
    graphs: Decision | None = None  # CUDA graphs around the step, decided in the same GPU call; not saved

    @property
    def fp8_config(self) -> Any:
        """torchao's config the FP8 packages' layers are quantized with (`fast_paths.fp8_config`), for
        whatever writes into them (LoRAs, `lora.Adapters`); None where every package is bf16."""
        return fp8_config(self.fp8_granularity) if self.fp8_granularity else None


def rel_error(out: Any, ref: Any) -> float:
    """max over output tensors of ||out - ref|| / ||ref||, in float64; NaN anywhere gives inf."""
    errors = []
    for o, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref), strict=True):
        o, r = o.double(), r.double()
        err = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
        errors.append(err if err == err else float("inf"))
    return max(errors)


def patch_blocks_(pipe: Any, compiled: Compiled) -> Report:
    """Patch every repeated block of `pipe.transformer` to run its class's package, in place.

    Each block keeps its parameters (the package binds to them: one copy of the weights). Nothing
    here runs on the GPU or loads a package (FP8 quantizes the weights where they are: emulated CUDA
    tensors in a ZeroGPU main process), so it runs in the main process everywhere. The FA3 kernel
    the packages call is imported here (`SharedPackage`; no GPU work), so ZeroGPU workers inherit it
    through fork instead of each importing it at its first step.

    Raises:
        ValueError: a block does not match its package, or the patched count is off.
        ImportError, OSError, RuntimeError: the FA3 kernel the packages call cannot be loaded (`load_fa3`).
    """
    if any(hasattr(m, "_hf_hook") for m in pipe.transformer.modules()):
        raise ValueError(
            "the transformer has accelerate offload hooks (enable_model_cpu_offload / "
            "enable_sequential_cpu_offload): they move weights between calls, while compiled blocks bind "
            "to the weights' memory once. Keep the pipeline on the GPU (pipe.to('cuda')) to compile it."
        )
    blocks = repeated_blocks(pipe.transformer)
    rows = []
    for name, found in blocks.items():
        package = compiled.packages[name]
        if package.fp8:
            for block in found:
                quantize_block_(block, fp8_config(package.fp8))
        for index, block in enumerate(found):
            check_constants(block, package, index)
        shared = SharedPackage(package, compiled.fa3_kernel)  # one load per class, not per block
        for block in found:
            patch_forward(block, CompiledBlock(block, shared))
        rows.append((package, len(found)))
    patches = [p for m in pipe.transformer.modules() if (p := patched_forward(m, CompiledBlock)) is not None]
    if hasattr(pipe.transformer, "_binding_check"):  # applied before: check the blocks patched now
        pipe.transformer._binding_check.remove()
    pipe.transformer._binding_check = pipe.transformer.register_forward_pre_hook(BindingCheck(patches))
    patched = len(patches)
    if patched != sum(count for _, count in rows):
        raise ValueError(f"patched {patched} blocks, expected {sum(count for _, count in rows)}")
    return Report(rows, compiled.decisions, compiled.resolution, compiled.source, compiled)


@dataclass
class Report:
    """What `apply.apply_` did: per block class, and every decision with its reason."""

    rows: list[tuple[BlockPackage, int]]
    decisions: list[Decision]
    resolution: Resolution
    source: str
    compiled: Compiled  # what was applied: another replica on the same GPU model binds it too

    def summary(self) -> str:
        """One line for a UI: what is compiled and which fast paths are on."""
        blocks = sum(count for _, count in self.rows)
        decisions = ", ".join(f"{d.name}: {d.value}" for d in self.decisions)
        classes = f"{len(self.rows)} block class{'es' * (len(self.rows) != 1)}"
        return f"AoT {self.source}: {classes}, {blocks} block{'s' * (blocks != 1)}; {decisions}"

    def __str__(self) -> str:
        lines = [
            "| block class | blocks | package | export s | compile s | rel. error vs eager | image tokens |",
            "|---|---|---|---|---|---|---|",
        ]
        with_references = False
        for package, count in self.rows:
            lo, hi = package.contract.image_range
            sees_image = any(any(t.image) for t in package.contract.tensors)  # Z-Image's context refiner does not
            with_references |= sees_image and (lo, hi) != self.resolution.token_range
            lines.append(
                f"| {package.block} | {count} | {len(package.package) / 1e6:.2f} MB | {package.export_s:.1f} "
                f"| {package.compile_s:.1f} | {package.rel_error:.1e} | {f'{lo}..{hi}' if sees_image else '-'} |"
            )
        lines.append(f"packages: {self.source}")
        if self.source != "compiled":
            lines.append("(export s, compile s and rel. error were measured when the packages were compiled)")
        lines.append(f"sizes: {self.resolution.describe()}")
        if with_references:
            lines.append(
                "image tokens: the blocks see the output's and the input image's (resized to the output), "
                "so their range is wider than the output's alone"
            )
        lines += [str(d) for d in self.decisions]
        return "\n".join(lines)

"""Regional ahead-of-time (AoT) compilation of a FLUX transformer, as the recipe's verbs.

    capture  record each repeated block class's real inputs from real pipeline calls
    export   torch.export one block per class, with the image-token dimension dynamic
    compile  AOTInductor: one weights-less package per class (a few MB, no parameters inside)
    apply    every block of the class runs that one package, bound to the block's own weights

`optimize_(pipe)` does all of it in place and returns a `Report`. On a ZeroGPU Space the first three
steps need the GPU worker and the last one runs in the main process, so `app.py` calls
`compile_blocks` (decorated with `@spaces.GPU`) and then `apply_`; only the small packages cross
the fork. Outside ZeroGPU `@spaces.GPU` changes nothing and everything runs in this process.

We use torch's public AOTI API (`torch.export.export`, `torch._inductor.aoti_compile_and_package`,
`torch._inductor.aoti_load_package`, `load_constants`) rather than `spaces.aoti_*`: spaces 0.51.3's
AoT module cannot be imported with a CPU-only torch (it reads CUDA attributes at import), and the
tests and CI run on CPU. The steps are the same ones `spaces.aoti_*` wrap.

    python compile.py --model assets/tiny-flux        # compile, check against eager, print the report
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import io
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import spaces
import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

from fast_paths import (
    FP8_MAX_REL_ERROR,
    Decision,
    fp8_config,
    load_fa3,
    quantize_block_,
    resolve_attention,
    resolve_fp8,
)
from options import Options, Resolution

log = logging.getLogger("compile")

# Inputs are captured at this size (the shape hint Inductor tunes for; FLUX.1-dev's default size)
# and once more at the smallest size, to find which input dimensions follow the image-token count.
CAPTURE_SIZE = (1024, 1024)
# Inductor settings for every package. Weights stay out of the package: each block binds its own.
INDUCTOR_CONFIGS: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
}
# Compiled block vs eager block on the captured inputs, ||out - ref|| / ||ref||. bf16 and fp32
# packages land far below; a larger error means the package computes something else.
MAX_REL_ERROR = 1e-2
# Largest transformer `load_pipeline` runs on a CPU: FLUX.1-dev (12B) would need ~48 GB in float32
# and minutes per step.
CPU_MAX_PARAMS = 1_000_000_000

Call = tuple[tuple[Any, ...], dict[str, Any]]


# --------------------------------------------------------------------------------------------
# capture -> export -> compile


@contextlib.contextmanager
def capture(modules: dict[str, torch.nn.Module]):
    """Record the first call's inputs of each module while the block runs as usual.

    Yields a dict filled in as the modules are called: name -> (args, kwargs), args bound to
    keyword names by the module's forward signature.
    """
    calls: dict[str, Call] = {}
    handles = []
    for name, module in modules.items():

        def record(module, args, kwargs, name=name):
            if name not in calls:
                calls[name] = ((), dict(forward_signature(module).bind(*args, **kwargs).arguments))

        handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def forward_signature(module: torch.nn.Module) -> inspect.Signature:
    """The signature of the class's own `forward`, without `self` (also once `forward` is patched)."""
    signature = inspect.signature(type(module).forward)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def capture_blocks(
    pipe: Any, firsts: dict[str, torch.nn.Module], sizes: list[tuple[int, int]]
) -> list[dict[str, Call]]:
    """Capture every block class's inputs from one real one-step pipeline call per size.

    Raises:
        RuntimeError: a block class was not called by the pipeline.
    """
    captured = []
    for height, width in sizes:
        with capture(firsts) as calls:
            pipe("capture", height=height, width=width, num_inference_steps=1, output_type="latent")
        missing = sorted(set(firsts) - set(calls))
        if missing:
            raise RuntimeError(f"the pipeline call at {height}x{width} never called {', '.join(missing)}")
        captured.append(calls)
    return captured


@dataclass(frozen=True)
class TensorSpec:
    """What a compiled block accepts for one tensor input: shape with dynamic dims, dtype, device."""

    path: str
    shape: tuple[int | None, ...]  # None: this dim is image tokens + offsets[dim]
    offsets: tuple[int, ...]
    dtype: torch.dtype
    device: str


@dataclass(frozen=True)
class Contract:
    """The inputs a package accepts; checked before every compiled call (AOTI itself checks none)."""

    block: str
    tree: pytree.TreeSpec  # structure of the kwargs, non-tensor values included
    tensors: tuple[TensorSpec, ...]
    constants: tuple[Any, ...]  # captured non-tensor leaves; must be equal at every call
    resolution: Resolution

    def check(self, kwargs: dict[str, Any]) -> None:
        """Raise `ValueError` naming what differs from the compiled inputs."""
        leaves, tree = pytree.tree_flatten(kwargs)
        if tree != self.tree:
            raise ValueError(f"{self.block} was compiled for inputs {self.tree}; got {tree}")
        tensors = iter(self.tensors)
        constants = iter(self.constants)
        tokens = None
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
                    have_tokens = have - spec.offsets[dim]
                    tokens = have_tokens if tokens is None else tokens
                    lo, hi = self.resolution.token_range
                    if have_tokens != tokens or not lo <= have_tokens <= hi:
                        raise ValueError(
                            f"{self.block} was compiled for {self.resolution.describe()}; "
                            f"{spec.path} has {have_tokens} image tokens (shape {tuple(leaf.shape)})"
                        )
                elif want != have:
                    raise ValueError(
                        f"{self.block} was compiled for {spec.path} of shape {_shape_str(spec)}; "
                        f"got {tuple(leaf.shape)} (batch size and text length are fixed at compile time)"
                    )


def _shape_str(spec: TensorSpec) -> str:
    dims = [
        ("T" if not off else f"T+{off}") if d is None else str(d)
        for d, off in zip(spec.shape, spec.offsets, strict=True)
    ]
    return "[" + ", ".join(dims) + "], T = image tokens"


def contract_from_captures(block: str, calls: list[Call], tokens: list[int], resolution: Resolution) -> Contract:
    """Find the inputs that follow the image-token count by comparing captures at two sizes.

    A dimension that changes between the captures must equal image tokens plus a constant offset
    (`image_rotary_emb` covers text + image tokens); every other dimension is fixed.

    Raises:
        ValueError: the captures differ in structure or in a way the rule cannot describe.
    """
    (_, first), (_, second) = calls
    leaves_a, tree = pytree.tree_flatten_with_path(first)
    leaves_b, tree_b = pytree.tree_flatten_with_path(second)
    if tree != tree_b:
        raise ValueError(f"{block}: inputs differ in structure between captures: {tree} vs {tree_b}")
    specs, constants = [], []
    for (path, a), (_, b) in zip(leaves_a, leaves_b, strict=True):
        name = _path_name(path)
        if not isinstance(a, torch.Tensor):
            constants.append(a)
            continue
        shape, offsets = [], []
        for dim, (da, db) in enumerate(zip(a.shape, b.shape, strict=True)):
            if da == db:
                shape.append(da)
                offsets.append(0)
            elif da - tokens[0] == db - tokens[1]:
                shape.append(None)
                offsets.append(da - tokens[0])
            else:
                raise ValueError(
                    f"{block}: {name} dim {dim} is {da} at {tokens[0]} image tokens and {db} at {tokens[1]}: "
                    "not image tokens plus a constant, so one dynamic graph cannot serve both"
                )
        specs.append(TensorSpec(name, tuple(shape), tuple(offsets), a.dtype, a.device.type))
    return Contract(block, pytree.tree_structure(first), tuple(specs), tuple(constants), resolution)


def _path_name(path: tuple) -> str:
    """`image_rotary_emb[0]` for the pytree path ('image_rotary_emb', 0)."""
    name = pytree.keystr(path)  # "['image_rotary_emb'][0]"
    return name.replace("['", ".").replace("']", "").lstrip(".")


def dynamic_shapes(contract: Contract, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The `dynamic_shapes` spec for `torch.export.export`, covering every captured kwarg."""
    lo, hi = contract.resolution.token_range
    image = Dim("image_tokens", min=lo, max=hi)
    specs = iter(contract.tensors)

    def dims(leaf):
        if not isinstance(leaf, torch.Tensor):
            return None
        spec = next(specs)
        dynamic = {
            d: image + off if off else image
            for d, (s, off) in enumerate(zip(spec.shape, spec.offsets, strict=True))
            if s is None
        }
        return dynamic or None

    return pytree.tree_map(dims, kwargs)


def export_block(block: torch.nn.Module, kwargs: dict[str, Any], contract: Contract) -> torch.export.ExportedProgram:
    """`torch.export` one block on its captured inputs, with the image-token dim dynamic."""
    with torch.no_grad():
        return torch.export.export(block, args=(), kwargs=kwargs, dynamic_shapes=dynamic_shapes(contract, kwargs))


def compile_package(exported: torch.export.ExportedProgram) -> bytes:
    """AOTInductor-compile `exported` into a weights-less `.pt2` package; returns its bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "package.pt2")
        torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=INDUCTOR_CONFIGS)
        with open(path, "rb") as f:
            return f.read()


# --------------------------------------------------------------------------------------------
# apply: one package per class, every block bound to its own weights


def block_constants(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The block's parameters and buffers under the names a package uses for its constants.

    Tensor-subclass weights (torchao quantization) are exported as their inner tensors under
    `<module>.parametrizations.weight.original<i>`; torch's `unwrap_tensor_subclass_parameters`
    gives the same names. It runs on a shallow clone, so `block` is untouched and no tensor is
    copied: the returned tensors are the block's own storage.
    """
    from torch._functorch._aot_autograd.subclass_parametrization import unwrap_tensor_subclass_parameters

    clone = _shallow_clone(block)
    unwrap_tensor_subclass_parameters(clone)
    return clone.state_dict(keep_vars=True)


def _shallow_clone(module: torch.nn.Module) -> torch.nn.Module:
    clone = object.__new__(type(module))
    clone.__dict__ = module.__dict__.copy()
    clone._parameters = module._parameters.copy()
    clone._buffers = module._buffers.copy()
    clone._modules = {name: _shallow_clone(child) for name, child in module._modules.items() if child is not None}
    return clone


@dataclass
class BlockPackage:
    """A compiled block class: the package bytes and what it needs at run time. Picklable."""

    block: str
    package: bytes
    contract: Contract
    constants: dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype)
    fp8: bool
    export_s: float
    compile_s: float
    rel_error: float


class CompiledBlock:
    """Replaces one block's `forward`: checks the inputs, then runs the class's package.

    The package is loaded at the first call (on ZeroGPU that is inside the GPU worker) and bound
    once to this block's own tensors (`load_constants(user_managed=True)`: no copy).
    """

    def __init__(self, block: torch.nn.Module, package: BlockPackage, index: int):
        self.block, self.package, self.index = block, package, index
        self._signature = forward_signature(block)
        self._runner = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = dict(self._signature.bind(*args, **kwargs).arguments)
        self.package.contract.check(kwargs)
        if self._runner is None:
            with self._lock:
                if self._runner is None:
                    self._runner = self._load()
        return self._runner(**kwargs)

    def _load(self):
        runner = torch._inductor.aoti_load_package(io.BytesIO(self.package.package))
        constants = block_constants(self.block)
        runner.load_constants(
            {name: constants[name] for name in runner.get_constant_fqns()}, check_full_update=True, user_managed=True
        )
        return runner


def check_constants(block: torch.nn.Module, package: BlockPackage, index: int) -> None:
    """Raise `ValueError` unless `block` holds every constant the package needs, same shape and dtype.

    Catches a package applied to other weights (another model, `fuse_qkv_projections` after
    capture, FP8 on one side only) before any call, instead of a crash inside the package.
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
    """The transformer's repeated blocks by class name, from `transformer._repeated_blocks`.

    Raises:
        ValueError: the attribute is missing, or a listed class has no instance in the model.
    """
    names = getattr(transformer, "_repeated_blocks", None)
    if not names:
        raise ValueError(
            f"{type(transformer).__name__} has no `_repeated_blocks`: regional compilation needs the "
            "list of repeated block class names (diffusers sets it on FluxTransformer2DModel)"
        )
    found = {name: [m for m in transformer.modules() if type(m).__name__ == name] for name in names}
    empty = [name for name, blocks in found.items() if not blocks]
    if empty:
        raise ValueError(
            f"{type(transformer).__name__}._repeated_blocks lists {', '.join(empty)}, "
            "but the model has no block of that class"
        )
    return found


# --------------------------------------------------------------------------------------------
# The entry points


@dataclass
class Compiled:
    """What `compile_blocks` returns: one package per block class plus the decisions. Picklable."""

    packages: dict[str, BlockPackage]
    decisions: list[Decision]
    resolution: Resolution
    fa3_kernel: str | None
    fp8_granularity: str


def rel_error(out: Any, ref: Any) -> float:
    """max over output tensors of ||out - ref|| / ||ref||, in float64; NaN anywhere gives inf."""
    errors = []
    for o, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref), strict=True):
        o, r = o.double(), r.double()
        err = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
        errors.append(err if err == err else float("inf"))
    return max(errors)


@spaces.GPU(duration=1500)
def compile_blocks(pipe: Any, options: Options | None = None) -> Compiled:
    """Capture, export and compile one package per repeated block class of `pipe.transformer`.

    Leaves `pipe` as it was (FP8 is tried on a copy of one block). On ZeroGPU this runs in the GPU
    worker: everything CUDA (capability probes, kernel loads, autotuning) happens here, and only
    the returned packages cross back to the main process.

    Raises:
        ValueError: no repeated blocks, or inputs the shape rule cannot describe.
        RuntimeError: a fast path was explicitly requested but cannot run, or a compiled block
            does not match its eager block.
    """
    options = options or Options()
    transformer = pipe.transformer
    blocks = repeated_blocks(transformer)
    resolution = options.resolution(pipe.vae_scale_factor)
    attention = resolve_attention(options, transformer, transformer.device)
    fp8 = resolve_fp8(options, transformer.device)
    log.info("%s", attention)

    capture_size = tuple(min(max(s, resolution.min_side), resolution.max_side) for s in CAPTURE_SIZE)
    sizes = [capture_size, (resolution.min_side, resolution.min_side)]
    if resolution.tokens(*sizes[0]) == resolution.tokens(*sizes[1]):
        sizes[1] = (resolution.max_side, resolution.max_side)
    firsts = {name: found[0] for name, found in blocks.items()}
    captures = capture_blocks(pipe, firsts, sizes)
    tokens = [resolution.tokens(*size) for size in sizes]

    packages, fp8_notes = {}, []
    for name, block in firsts.items():
        calls = [c[name] for c in captures]
        contract = contract_from_captures(name, calls, tokens, resolution)
        kwargs = calls[0][1]
        with torch.no_grad():
            reference = block(**kwargs)
        package = None
        if fp8.value == "on":
            quantized = copy.deepcopy(block)
            counts = quantize_block_(quantized, fp8_config(options.fp8_granularity))
            package = _compile_class(name, quantized, kwargs, contract, attention, reference, fp8=True)
            fp8_notes.append(
                f"{name}: {counts[0]} linear layers in FP8, {counts[1]} kept, rel. error {package.rel_error:.1e}"
            )
            del quantized
            if package.rel_error > FP8_MAX_REL_ERROR and options.fp8 == "auto":
                fp8_notes[-1] += f" > {FP8_MAX_REL_ERROR:.0e}: kept in bf16"
                package = None
        if package is None:
            package = _compile_class(name, block, kwargs, contract, attention, reference, fp8=False)
            if package.rel_error > MAX_REL_ERROR:
                raise RuntimeError(
                    f"{name}: compiled package differs from eager by {package.rel_error:.2e} (relative), "
                    f"above {MAX_REL_ERROR:.0e}"
                )
        packages[name] = package
    if fp8.value == "on":
        fp8 = Decision(
            "fp8", "on" if any(p.fp8 for p in packages.values()) else "off", f"{fp8.reason}; " + "; ".join(fp8_notes)
        )
    log.info("%s", fp8)
    kernel = options.fa3_kernel if attention.value == "fa3" else None
    return Compiled(packages, [attention, fp8], resolution, kernel, options.fp8_granularity)


def _compile_class(
    name: str,
    block: torch.nn.Module,
    kwargs: dict[str, Any],
    contract: Contract,
    attention: Decision,
    reference: Any,
    fp8: bool,
) -> BlockPackage:
    """Export and compile `block`, then run the package once against the eager `reference`."""
    from diffusers.models.attention_dispatch import attention_backend

    start = time.perf_counter()
    with attention_backend("_flash_3" if attention.value == "fa3" else "native"):
        exported = export_block(block, kwargs, contract)
    export_s = time.perf_counter() - start
    if attention.value == "fa3":
        op = torch.ops._diffusers_flash_attn_3._flash_attn_forward.default
        if not any(node.target is op for node in exported.graph.nodes):
            raise RuntimeError(f"{name}: attention=fa3, but the exported graph calls no FA3 op")
    start = time.perf_counter()
    package = compile_package(exported)
    compile_s = time.perf_counter() - start
    runner = torch._inductor.aoti_load_package(io.BytesIO(package))
    constants = block_constants(block)
    names = runner.get_constant_fqns()
    runner.load_constants({n: constants[n] for n in names}, check_full_update=True, user_managed=True)
    with torch.no_grad():
        error = rel_error(runner(**kwargs), reference)
    log.info(
        "%s: exported in %.1fs, compiled in %.1fs, %d bytes, rel. error %.1e",
        name,
        export_s,
        compile_s,
        len(package),
        error,
    )
    return BlockPackage(
        block=name,
        package=package,
        contract=contract,
        constants={n: (tuple(constants[n].shape), constants[n].dtype) for n in names},
        fp8=fp8,
        export_s=export_s,
        compile_s=compile_s,
        rel_error=error,
    )


def apply_(pipe: Any, compiled: Compiled) -> Report:
    """Patch every repeated block of `pipe.transformer` to run its class's package, in place.

    Each block keeps its parameters (the package binds to them: one copy of the weights).

    Raises:
        ValueError: a block does not match its package, or the patched count is off.
    """
    if any(hasattr(m, "_hf_hook") for m in pipe.transformer.modules()):
        raise ValueError(
            "the transformer has accelerate offload hooks (enable_model_cpu_offload / "
            "enable_sequential_cpu_offload): they move weights between calls, while compiled blocks bind "
            "to the weights' memory once. Keep the pipeline on the GPU (pipe.to('cuda')) to compile it."
        )
    if compiled.fa3_kernel is not None:
        load_fa3(compiled.fa3_kernel)  # the packages call the FA3 op: register its kernel first
    blocks = repeated_blocks(pipe.transformer)
    rows = []
    for name, found in blocks.items():
        package = compiled.packages[name]
        if package.fp8:
            for block in found:
                quantize_block_(block, fp8_config(compiled.fp8_granularity))
        for index, block in enumerate(found):
            check_constants(block, package, index)
        for index, block in enumerate(found):
            block.forward = CompiledBlock(block, package, index)
        rows.append((package, len(found)))
    patched = sum(isinstance(m.__dict__.get("forward"), CompiledBlock) for m in pipe.transformer.modules())
    if patched != sum(count for _, count in rows):
        raise ValueError(f"patched {patched} blocks, expected {sum(count for _, count in rows)}")
    return Report(rows, compiled.decisions, compiled.resolution)


def optimize_(pipe: Any, options: Options | None = None) -> Report:
    """Regionally AoT-compile `pipe.transformer` in place: `apply_(pipe, compile_blocks(pipe, options))`."""
    return apply_(pipe, compile_blocks(pipe, options))


@dataclass
class Report:
    """What `optimize_` did: per block class, and every decision with its reason."""

    rows: list[tuple[BlockPackage, int]]
    decisions: list[Decision]
    resolution: Resolution

    def summary(self) -> str:
        """One line for a UI: what is compiled and which fast paths are on."""
        blocks = sum(count for _, count in self.rows)
        decisions = ", ".join(f"{d.name}: {d.value}" for d in self.decisions)
        return f"AoT-compiled: {len(self.rows)} block classes, {blocks} blocks; {decisions}"

    def __str__(self) -> str:
        lines = [
            "| block class | blocks | package | export s | compile s | rel. error vs eager | image tokens |",
            "|---|---|---|---|---|---|---|",
        ]
        lo, hi = self.resolution.token_range
        for package, count in self.rows:
            lines.append(
                f"| {package.block} | {count} | {len(package.package) / 1e6:.2f} MB | {package.export_s:.1f} "
                f"| {package.compile_s:.1f} | {package.rel_error:.1e} | {lo}..{hi} |"
            )
        lines.append(f"sizes: {self.resolution.describe()}")
        lines += [str(d) for d in self.decisions]
        return "\n".join(lines)


def load_pipeline(options: Options) -> Any:
    """Load `options.model` as a `FluxPipeline` on `options.device` in `options.dtype`.

    Raises:
        RuntimeError: the model cannot be fetched, or it is too large to run without CUDA.
    """
    from diffusers import FluxPipeline, FluxTransformer2DModel

    cuda = torch.cuda.is_available()
    device = torch.device(options.device if options.device != "auto" else "cuda" if cuda else "cpu")
    dtype = getattr(torch, options.dtype) if options.dtype != "auto" else torch.bfloat16 if cuda else torch.float32
    try:
        config = FluxTransformer2DModel.load_config(options.model, subfolder="transformer")
    except OSError as exc:
        raise RuntimeError(
            f"cannot load {options.model!r} ({exc}). Offline, or without access to a gated Hub repo, "
            "run the bundled tiny pipeline: MODEL_ID=assets/tiny-flux"
        ) from exc
    if device.type == "cpu":
        with torch.device("meta"):
            params = sum(p.numel() for p in FluxTransformer2DModel.from_config(config).parameters())
        if params > CPU_MAX_PARAMS:
            raise RuntimeError(
                f"{options.model} has a {params / 1e9:.1f}B-parameter transformer ({params * 2 / 1e9:.0f} GB in "
                "bfloat16): it needs a CUDA GPU with room for it and the text encoders. Without one, run the "
                "bundled tiny pipeline: MODEL_ID=assets/tiny-flux"
            )
    return FluxPipeline.from_pretrained(options.model, dtype=dtype).to(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, parents=[Options.parser()], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    options = Options.from_env(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    pipe = load_pipeline(options)
    start = time.perf_counter()
    report = optimize_(pipe, options)
    print(report)
    print(f"regional compile: {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

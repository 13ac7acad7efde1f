"""LoRAs on compiled blocks: fused at startup, or switched per request without recompiling.

A compiled block runs a weights-less package bound to the block's own tensors (runner.bind: no
copy), so writing a LoRA's product into those tensors in place changes what the package computes,
and what a captured CUDA graph replays. That is the whole mechanism; nothing is recompiled:

    fuse_(pipe, specs)        startup (AOT_LORA): W += scale * s * B @ A in every targeted layer,
                              before compiling or binding, so the FP8 trial and FP8 weights see it
    Adapters(pipe, specs)     per request (AOT_LORA_CHOICES): `use(name)` writes base + that LoRA
                              into the targeted layers in place; `use(None)` writes the base back
    forbid_peft_(pipe)        after `apply_`: diffusers/peft adapter calls raise, naming these

The LoRA is read by diffusers and peft as `pipe.load_lora_weights` reads it (the pipeline class's
own format conversions: kohya, xlabs, BFL, ...), into a skeleton of the transformer on the meta
device (no memory): peft decides which layers it targets and their scaling s (lora_alpha / r, or
per-layer alphas); the factors A [r, in] and B [out, r] are the file's own tensors. Standard LoRA on
`nn.Linear` layers of the transformer only: DoRA, LoRA biases, text-encoder layers and layers whose
shape the LoRA changes (FLUX Control LoRAs) are refused with the reason. Layers outside the repeated
blocks (FLUX's `x_embedder`, `proj_out`) run eagerly on the same tensors: handled the same way.

Only safetensors files are read (`use_safetensors=True`): a pickled LoRA could run code.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from typing import Any

import torch
from safetensors import SafetensorError

from aot.lora_specs import LoraSpec

log = logging.getLogger("lora")


# One targeted layer of one LoRA: A [r, in], B [out, r] (float32, CPU), and s * scale.
Factors = tuple[torch.Tensor, torch.Tensor, float]


def read(pipe: Any, spec: LoraSpec) -> dict[str, Factors]:
    """The LoRA's factors per targeted layer of `pipe.transformer`, by module path. Touches no weight.

    Raises:
        ValueError: the pipeline class has no LoRA loader, the file is not a readable safetensors
            file, the LoRA has layers this template does not apply (see the module docstring), or
            its shapes do not fit the transformer.
        OSError: the file or repo cannot be read (diffusers' message, after the LoRA's name).
    """
    from peft.tuners.lora import LoraLayer  # heavy: at first use

    loader = type(pipe)
    if not hasattr(loader, "load_lora_weights"):
        raise ValueError(f"LoRA {spec.name}: diffusers has no LoRA loader for {loader.__name__}")
    with _naming(spec):
        out = loader.lora_state_dict(**spec.load_kwargs())
    state_dict = out[0] if isinstance(out, tuple) else out
    others = sorted({key.split(".")[0] for key in state_dict if not key.startswith("transformer.")})
    if others:
        raise ValueError(
            f"LoRA {spec.name}: has layers of {', '.join(others)}; only transformer LoRAs are applied here"
        )
    biases = [key for key in state_dict if ".lora_B." in key and key.endswith(".bias")]
    if biases:
        raise ValueError(f"LoRA {spec.name}: has LoRA biases ({biases[0]}...); only plain LoRA (no bias) is applied")
    with torch.device("meta"):
        skeleton = type(pipe.transformer).from_config(pipe.transformer.config)
    shell = object.__new__(loader)  # the pipeline's loader methods, bound to the skeleton alone
    shell.__dict__.update(pipe.__dict__, transformer=skeleton, text_encoder=None)  # refused above anyway
    quiet = logging.getLogger("diffusers.loaders.lora_base")  # "No LoRA keys associated to NoneType"
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with _naming(spec):
            shell.load_lora_weights(**spec.load_kwargs(), adapter_name="read")
    finally:
        quiet.setLevel(level)
    weights = dict(pipe.transformer.named_modules())
    factors = {}
    for path, layer in skeleton.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        if layer.use_dora.get("read"):
            raise ValueError(f"LoRA {spec.name}: {path} is DoRA; only plain LoRA is applied")
        target = weights.get(path)
        if not isinstance(target, torch.nn.Linear):
            raise ValueError(f"LoRA {spec.name}: {path} is not a linear layer of this transformer")
        a = state_dict[f"transformer.{path}.lora_A.weight"].float()
        b = state_dict[f"transformer.{path}.lora_B.weight"].float()
        if (b.shape[0], a.shape[1]) != (target.out_features, target.in_features):
            raise ValueError(
                f"LoRA {spec.name}: {path} is [{b.shape[0]}, {a.shape[1]}] in the LoRA, "
                f"[{target.out_features}, {target.in_features}] in the model (a LoRA that reshapes layers)"
            )
        factors[path] = (a, b, layer.scaling["read"] * spec.scale)
    if not factors:
        raise ValueError(f"LoRA {spec.name}: targets no layer of {type(pipe.transformer).__name__}")
    return factors


@contextlib.contextmanager
def _naming(spec: LoraSpec):
    """Re-raise diffusers' read errors with the LoRA's name: with several LoRAs offered, its raw
    `SafetensorError` or `OSError` does not say which one failed."""
    try:
        yield
    except SafetensorError as exc:
        raise spec.unreadable(spec.source, exc) from exc
    except OSError as exc:
        raise OSError(f"LoRA {spec.name}: cannot read {spec.source}: {exc}") from exc


def _delta(factors: Factors, device: torch.device) -> torch.Tensor:
    """s * B @ A in float32 on `device`: [out, in]."""
    a, b, scale = factors
    return (b.to(device) @ a.to(device)).mul_(scale)


def fuse_(pipe: Any, specs: list[LoraSpec]) -> int:
    """Add every LoRA's product to the transformer's weights, in place, before compiling (`load_pipeline`).

    In bfloat16 the sum is rounded once, as peft's `merge` rounds it. Returns the number of layers
    changed (a layer several LoRAs target counts once).

    Raises:
        ValueError, OSError: see `read`; nothing is changed then (all LoRAs are read first).
    """
    layers = dict(pipe.transformer.named_modules())
    reads = [(spec, read(pipe, spec)) for spec in specs]
    changed = set()
    with torch.no_grad():
        for spec, factors in reads:
            for path, f in factors.items():
                weight = layers[path].weight
                weight.copy_(weight.float() + _delta(f, weight.device))
                changed.add(path)
            log.info("fused LoRA %s (%s, scale %g) into %d layers", spec.name, spec.source, spec.scale, len(factors))
    return len(changed)


class Adapters:
    """LoRAs a request can switch to, written in place into the tensors the compiled blocks run on.

    `use(name)` makes the targeted layers base + that LoRA; `use(None)` makes them the base again,
    bit for bit: the base of every layer any offered LoRA targets is copied once, at the first
    switch in a process (on ZeroGPU, inside each GPU worker: the main process keeps the base), onto
    the weights' device when that leaves a quarter of its memory free, else into CPU memory. That
    copy is what the switching costs in memory: the targeted layers' weights once more
    (`base_bytes`). FP8 layers (torchao) keep their FP8 data as the base; a LoRA is added to its
    dequantized value and quantized again with the same config, so it carries FP8's rounding twice.

    Not thread-safe: one request per pipeline at a time (app.py's replicas hand each pipeline to one
    request at a time), so no request sees a half-written set.
    """

    def __init__(self, pipe: Any, specs: list[LoraSpec], fp8_config: Any = None):
        """Reads every LoRA now (CPU, no weight touched). `fp8_config`: the torchao config FP8
        layers were quantized with (`fp8.fp8_config`), needed only when they are.

        Raises:
            ValueError, OSError: see `read`.
        """
        self.pipe, self.fp8_config = pipe, fp8_config
        self.loras = {spec.name: read(pipe, spec) for spec in specs}
        self.active: str | None = None
        self.base: dict[str, dict[str, torch.Tensor]] | None = None
        self.base_bytes = 0

    def for_pipeline(self, pipe: Any, fp8_config: Any = None) -> Adapters:
        """The same LoRAs for another pipeline of the same model (another replica), without reading
        them again: the factors are shared (read-only); the base copy and the active LoRA are its own."""
        other = copy.copy(self)
        other.pipe, other.fp8_config, other.active, other.base, other.base_bytes = pipe, fp8_config, None, None, 0
        return other

    @property
    def names(self) -> list[str]:
        return list(self.loras)

    def use(self, name: str | None) -> float:
        """Make LoRA `name` (None: none) the one the pipeline runs; returns the seconds it took.

        Raises:
            ValueError: an unknown name, saying which are offered.
        """
        if name is not None and name not in self.loras:
            offered = ", ".join(self.loras) or "none"
            raise ValueError(f"LoRA {name!r} is not offered; offered: {offered}")
        if name == self.active:
            return 0.0
        start = time.perf_counter()
        layers = dict(self.pipe.transformer.named_modules())
        if self.base is None:
            self.base = self._copy_base(layers)
        touched = set(self.loras.get(self.active, {})) | set(self.loras.get(name, {}))
        self.active = None  # until every layer is written: an exception leaves "unknown", not a lie
        with torch.no_grad():
            for path in touched:
                factors = self.loras[name].get(path) if name is not None else None
                _write(layers[path], self.base[path], factors, self.fp8_config)
        if self.pipe.transformer.device.type == "cuda":
            torch.cuda.synchronize(self.pipe.transformer.device)
        self.active = name
        seconds = time.perf_counter() - start
        log.info("LoRA %s in %.3f s (%d layers)", name or "none", seconds, len(touched))
        return seconds

    def _copy_base(self, layers: dict[str, torch.nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
        """A copy of every targeted layer's weight tensors (the inner ones for FP8)."""
        paths = sorted({path for factors in self.loras.values() for path in factors})
        weights = {path: inner_tensors(layers[path].weight) for path in paths}
        size = sum(t.numel() * t.element_size() for inner in weights.values() for t in inner.values())
        device = self.pipe.transformer.device
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            if free - size < total // 4:
                device = torch.device("cpu")
        self.base_bytes = size
        log.info("LoRA base copy: %.2f GB of %d layers on %s", size / 1e9, len(paths), device)
        pin = device.type == "cpu" and self.pipe.transformer.device.type == "cuda"  # faster copies back

        def copy(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, copy=True).pin_memory() if pin else t.to(device, copy=True)

        return {path: {n: copy(t) for n, t in inner.items()} for path, inner in weights.items()}


def inner_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A weight's plain tensors by name: itself, or a tensor subclass's inner tensors (torchao FP8)."""
    if type(weight) in (torch.Tensor, torch.nn.Parameter):
        return {"": weight.data}
    names, _ = weight.__tensor_flatten__()
    return {n: getattr(weight, n) for n in names}


def _write(layer: torch.nn.Linear, base: dict[str, torch.Tensor], factors: Factors | None, fp8_config: Any) -> None:
    """Write base (+ the LoRA's product) into `layer`'s weight tensors, in place."""
    inner = inner_tensors(layer.weight)
    if factors is None:
        for n, t in inner.items():
            t.copy_(base[n], non_blocking=True)
        return
    device = layer.weight.device
    if "" in inner:
        inner[""].copy_(base[""].to(device).float() + _delta(factors, device))
        return
    if fp8_config is None:
        raise ValueError(f"{type(layer.weight).__name__} weights need the config they were quantized with")
    from torchao.quantization import quantize_  # heavy: at first use

    for n, t in inner.items():  # the base, to dequantize it in place of the weight
        t.copy_(base[n])
    high = layer.weight.dequantize()
    scratch = torch.nn.Linear(layer.in_features, layer.out_features, bias=False, device=device, dtype=high.dtype)
    scratch.weight.data = (high.float() + _delta(factors, device)).to(high.dtype)
    quantize_(scratch, fp8_config)
    for n, t in inner_tensors(scratch.weight).items():
        inner[n].copy_(t)


# PeftAdapterMixin's methods on the transformer: after `apply_` they would change modules or
# weights the compiled blocks never see (or raise a KeyError deep inside); each raises this instead.
PEFT_METHODS = (
    "add_adapter",
    "load_lora_adapter",
    "set_adapter",
    "set_adapters",
    "enable_adapters",
    "disable_adapters",
    "delete_adapters",
    "fuse_lora",
    "unfuse_lora",
    "enable_lora",
    "disable_lora",
    "unload_lora",
)


def forbid_peft_(pipe: Any) -> None:
    """Make the transformer's adapter methods raise: `pipe.load_lora_weights`, `pipe.fuse_lora`,
    `transformer.add_adapter` ... all go through them. A LoRA loaded that way after compiling would
    be silently ignored (compiled blocks run their bound weights, not peft's layers)."""
    for method in PEFT_METHODS:
        if hasattr(pipe.transformer, method):
            setattr(pipe.transformer, method, _refuse(method))


def _refuse(method: str):
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{method}: the transformer's blocks are compiled and run their bound weights, so a peft adapter "
            "added now would be ignored. Fuse LoRAs at startup (--lora / AOT_LORA) or offer them per request "
            "(--lora-choices / AOT_LORA_CHOICES; lora.Adapters in code)."
        )

    return refuse

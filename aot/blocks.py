"""The repeated blocks of a transformer as the engine sees them: which they are, the tensors a
package binds to, and putting a forward in front of a module's own (and taking it away)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def forward_signature(module: torch.nn.Module) -> inspect.Signature:
    """The signature of the class's own `forward`, without `self` (also once `forward` is patched)."""
    signature = inspect.signature(type(module).forward)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


@contextlib.contextmanager
def pre_hooks(modules: dict[str, torch.nn.Module], hook: Callable[..., None]) -> Iterator[None]:
    """Call `hook(name, module, args, kwargs)` before every call of each module of `modules` (by
    name) made inside, the call itself unchanged; the hooks are removed on the way out."""
    handles = [
        module.register_forward_pre_hook(lambda m, a, kw, name=name: hook(name, m, a, kw), with_kwargs=True)
        for name, module in modules.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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


def rel_error(out: Any, ref: Any) -> float:
    """max over output tensors of ||out - ref|| / ||ref||, in float64; NaN anywhere gives inf."""
    errors = []
    for o, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref), strict=True):
        o, r = o.double(), r.double()
        err = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
        errors.append(err if err == err else float("inf"))
    return max(errors)


"""The input contract of a compiled block: what its package accepts, solved from captured calls and
checked before every call (AOTInductor itself checks no input shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from aot.resolution import Resolution

# One captured call of a block: (args, kwargs), as its forward received them.
CapturedCall = tuple[tuple[Any, ...], dict[str, Any]]


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
        """A JSON-able description (for `saving.save_packages`); the resolution is stored beside it."""
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

    def check_inputs(self, kwargs: dict[str, Any]) -> None:
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
    calls: list[CapturedCall],
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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The dtype `dtype_name` wrote as `name`. Raises `ValueError` for any other name (it comes from a file)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype

"""LoRA specs: the `[name=]source[:scale]` items of `--lora` and `--lora-choices`, parsed and checked
before any weight loads (lora.py reads and applies them)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from safetensors import SafetensorError, safe_open


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA: `name` (what a request picks), `source` (folder, .safetensors file, or Hub repo
    `owner/name` with an optional `/file.safetensors`), `scale` (multiplies its product)."""

    name: str
    source: str
    scale: float = 1.0

    def check_source(self) -> None:
        """Raise `ValueError` unless `source` is an existing path or has a Hub repo id's shape, and,
        for a local source, unless the file diffusers would read (`local_file`) has a readable
        safetensors header that covers the file. Runs before any weight is loaded: a corrupt or
        truncated LoRA costs seconds here, not a load and a compile before diffusers' raw error.
        A Hub source is not downloaded here; whether the repo exists, diffusers finds out (`read`).
        """
        if not os.path.exists(self.source) and not HUB_SOURCE.fullmatch(self.source):
            raise ValueError(
                f"LoRA {self.name}: {self.source!r} is neither a file or folder here nor a Hub repo "
                "(owner/name or owner/name/file.safetensors)"
            )
        path = self.local_file()
        problem = safetensors_problem(path) if path else None
        if problem:
            raise self.unreadable(path, problem)

    def unreadable(self, path: str, why: object) -> ValueError:
        """The error for a LoRA file that is not readable safetensors, naming the LoRA and `why`."""
        return ValueError(f"LoRA {self.name}: {path} is not a readable safetensors file ({why})")

    def local_file(self) -> str | None:
        """The file diffusers reads for a local `source`, or None for a Hub source.

        A file is read as safetensors whatever its name (`use_safetensors=True`). In a folder,
        diffusers (`lora_base._best_guess_weight_name`, 0.42) picks among the `.safetensors` files
        at its top level, in `os.listdir` order, those without scheduler, optimizer or checkpoint in
        their name, preferring `pytorch_lora_weights.safetensors`, and takes the first: the same
        rule, on the same listing, picks the same file here.

        Raises:
            ValueError: a folder with no such file (diffusers would fail on it, or raise IndexError).
        """
        if not os.path.exists(self.source):
            return None
        if not os.path.isdir(self.source):
            return self.source
        found = [
            name
            for name in os.listdir(self.source)
            if name.endswith(".safetensors") and not any(s in name for s in ("scheduler", "optimizer", "checkpoint"))
        ]
        preferred = [name for name in found if name.endswith(DIFFUSERS_LORA_FILE)]
        picked = (preferred or found)[:1]
        if not picked:
            raise ValueError(
                f"LoRA {self.name}: the folder {self.source} holds no .safetensors LoRA file (only safetensors "
                "are read; names with scheduler, optimizer or checkpoint are skipped); name the file instead"
            )
        return os.path.join(self.source, picked[0])

    def load_kwargs(self) -> dict[str, Any]:
        """Arguments for diffusers' `lora_state_dict`/`load_lora_weights`: the path or repo first."""
        parts = self.source.split("/")
        if not os.path.exists(self.source) and len(parts) > 2 and self.source.endswith(".safetensors"):
            where = {"pretrained_model_name_or_path_or_dict": "/".join(parts[:2]), "weight_name": "/".join(parts[2:])}
        else:
            where = {"pretrained_model_name_or_path_or_dict": self.source}
        return {**where, "use_safetensors": True}


# The file name diffusers prefers in a LoRA folder (`diffusers.loaders.lora_base.LORA_WEIGHT_NAME_SAFE`).
DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"


def safetensors_problem(path: str) -> str | None:
    """Why `path` is not a readable safetensors file, or None; reads its header only.

    `safe_open` parses the 8-byte length and the JSON header and checks that the tensors it lists
    cover the file exactly, so text saved as `.safetensors` and a truncated file are both caught
    in milliseconds (the tensors are memory-mapped, not read). Corrupt tensor bytes are not.
    """
    try:
        with safe_open(path, framework="pt"):
            return None
    except (SafetensorError, OSError) as exc:
        return str(exc)


HUB_SOURCE = re.compile(r"[\w.-]+/[\w.-]+(/[\w./-]+\.safetensors)?")


SPEC = re.compile(r"(?:(?P<name>[\w.-]+)=)?(?P<source>[^,:=]+)(?::(?P<scale>-?[0-9.]+))?")


def parse(text: str | None) -> list[LoraSpec]:
    """`[name=]source[:scale]` items, comma-separated, as `LoraSpec`s; None or "" gives [].

    The name defaults to the file's stem or the repo's name (`owner/flux-ghibli` -> `flux-ghibli`).

    Raises:
        ValueError: an item that does not parse, a scale that is not a number, two LoRAs with one
            name (the UI and API pick them by name), or one named `none` (no LoRA).
    """
    specs = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        match = SPEC.fullmatch(item)
        try:
            scale = float(match["scale"]) if match and match["scale"] else 1.0
        except ValueError:
            match = None
        if match is None:
            raise ValueError(
                f"LoRA {item!r}: use [name=]source[:scale], e.g. ghibli=owner/repo:0.8 or loras/style.safetensors"
            )
        source = match["source"]
        name = match["name"] or os.path.basename(source.rstrip("/")).removesuffix(".safetensors")
        specs.append(LoraSpec(name, source, scale))
    names = [spec.name for spec in specs]
    if "none" in names:
        raise ValueError("a LoRA named 'none': that name means no LoRA; name it with name=source")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"LoRA names must differ: {', '.join(duplicates)} used twice; name them with name=source")
    return specs

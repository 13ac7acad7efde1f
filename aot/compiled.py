"""What a compile or a load hands on: one package per block class (`BlockPackage`), the set with its
decisions (`Compiled`), and what applying it did (`Report`). Picklable: on ZeroGPU they cross the fork."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from aot.contract import Contract, dtype_name, parse_dtype
from aot.fp8 import fp8_config
from aot.plans import Decision
from aot.resolution import Resolution


@dataclass
class BlockPackage:
    """A compiled block class: the package bytes and what it needs at run time. Picklable."""

    block: str
    package: bytes
    contract: Contract
    constants: dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype)
    fp8: str | None  # the FP8 granularity its linear layers were quantized at (`options.FP8_GRANULARITIES`), or None
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


@dataclass
class Compiled:
    """What `compile_blocks` returns: one package per block class plus the decisions. Picklable."""

    packages: dict[str, BlockPackage]
    decisions: list[Decision]
    resolution: Resolution
    fa3_kernel: str | None
    fp8_granularity: str | None  # of the FP8 packages; None where every package is bf16
    fingerprint: dict[str, Any]  # what the packages are valid for (`fingerprint.fingerprint`)
    source: str = "compiled"  # or "loaded from <folder or repo>"
    text_fp8: Any = None  # the text encoders' FP8 trial in the same GPU call (`text_fp8.TextFP8`), not saved
    graphs: Decision | None = None  # CUDA graphs around the step, decided in the same GPU call; not saved

    @property
    def fp8_config(self) -> Any:
        """torchao's config the FP8 packages' layers are quantized with (`fp8.fp8_config`), for
        whatever writes into them (LoRAs, `lora.Adapters`); None where every package is bf16."""
        return fp8_config(self.fp8_granularity) if self.fp8_granularity else None


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

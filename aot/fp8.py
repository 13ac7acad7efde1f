"""FP8 in the blocks' linear layers: torchao's dynamic-activation, FP8-weight quantization, which
layers get it, and the cuBLASLt shape it must avoid (`BiasAfterGEMM`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from aot.blocks import pre_hooks

# An FP8 block vs the eager bf16 block on the same inputs; above this, `fp8=auto` keeps that class
# in bf16 (FP8 has 3 mantissa bits: a few percent is its normal cost; NaN or noise is far above).
FP8_MAX_REL_ERROR = 1e-1


# Linear layers FP8 pays off for: both dims multiples of 16 (FP8 GEMM alignment) and at least this
# wide; smaller ones stay in bf16 and are counted in the report.
FP8_MIN_FEATURES = 256


# A row-wise FP8 layer with a bias adds it after its GEMM (`BiasAfterGEMM`) where some captured call
# gave it this many input rows or fewer: cuBLASLt refuses such a GEMM at 1..32 rows (BiasAfterGEMM's
# docstring); the margin covers a prompt shorter than the captures'. Elsewhere the bias stays in the
# GEMM's epilogue: moving it out cost FLUX.1-dev and Chroma 4-6 ms a step (H200, BENCHMARKS.md).
BIAS_AFTER_GEMM_ROWS = 256


def fp8_config(granularity: str) -> Any:
    """torchao's FP8 dynamic-activation, FP8-weight config at `granularity` ("row" or "tensor").

    `set_inductor_config=False`: Inductor settings live in `INDUCTOR_CONFIGS`, not in a global
    that quantizing changes.
    """
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor  # heavy: at first use

    return Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow() if granularity == "row" else PerTensor(), set_inductor_config=False
    )


def quantize_block_(block: torch.nn.Module, config: Any, rows: dict[str, int] | None = None) -> tuple[int, int]:
    """Quantize the block's linear layers with torchao `config`, in place.

    Layers narrower than `FP8_MIN_FEATURES` or not 16-aligned stay as they are, and so do layers
    already quantized (so applying twice is harmless). `rows`: each linear layer's fewest input rows
    in the block's captured calls, by its name in the block (`fewest_rows`); row-wise, a quantized
    layer with a bias that saw at most `BIAS_AFTER_GEMM_ROWS` of them becomes a `BiasAfterGEMM`
    (none without `rows`: binding saved packages runs their graphs, not these layers). Returns
    (quantized, skipped) layer counts.
    """
    from torchao.quantization import quantize_  # heavy: at first use

    linears = {
        name: m
        for name, m in block.named_modules()
        if isinstance(m, torch.nn.Linear) and type(m.weight) is torch.nn.Parameter
    }
    eligible = {
        name
        for name, m in linears.items()
        if min(m.in_features, m.out_features) >= FP8_MIN_FEATURES
        and m.in_features % 16 == 0
        and m.out_features % 16 == 0
    }
    if eligible:
        chosen = {id(linears[name]) for name in eligible}
        quantize_(block, config, filter_fn=lambda m, _: id(m) in chosen)
        if _row_wise(config) and rows is not None:
            for name in eligible:
                few = rows.get(name, 0) <= BIAS_AFTER_GEMM_ROWS  # a layer no captured call ran: unknown, so few
                if few and linears[name].bias is not None:
                    linears[name].__class__ = BiasAfterGEMM
    return len(eligible), len(linears) - len(eligible)


@contextlib.contextmanager
def fewest_rows(block: torch.nn.Module) -> Iterator[dict[str, int]]:
    """Record each linear layer's fewest input rows (the product of all but the input's last dim:
    the GEMM's M) over the calls of `block` made inside; yields {layer name in the block: rows},
    filled in as they run. `quantize_block_` reads it."""
    rows: dict[str, int] = {}

    def record(name: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        if isinstance(x, torch.Tensor) and x.dim():
            count = x.numel() // x.shape[-1]
            rows[name] = min(count, rows.get(name, count))

    linears = {name: m for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    with pre_hooks(linears, record):
        yield rows


class BiasAfterGEMM(torch.nn.Linear):
    """A linear layer that adds its bias after its GEMM, not in the GEMM's epilogue.

    cuBLASLt refuses a row-wise scaled FP8 GEMM that has both a bias and fast accumulation (what
    torchao asks for) at 32 rows or fewer: `CUBLAS_STATUS_NOT_SUPPORTED` from
    `cublasLtMatmulAlgoGetHeuristic` for K=12288, N=3072 at M = 1..32, not at 48, 64 or 512, and
    not without the bias or without fast accumulation (torch 2.11.0+cu130, H200; BENCHMARKS.md,
    "cuBLASLt's 32-row refusal"). That is Qwen-Image's text MLP at a short prompt. Inductor fuses the add into the
    kernel that reads the GEMM's output. Same parameters and names as the `nn.Linear` it replaces.
    Only layers that see few rows get it (`BIAS_AFTER_GEMM_ROWS`).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(input, self.weight) + self.bias


def _row_wise(config: Any) -> bool:
    """Whether torchao `config` scales FP8 per row (its `granularity`: one, or one per operand)."""
    from torchao.quantization import PerRow  # heavy: at first use

    granularity = getattr(config, "granularity", None)
    return any(
        isinstance(g, PerRow) for g in (granularity if isinstance(granularity, (list, tuple)) else [granularity])
    )

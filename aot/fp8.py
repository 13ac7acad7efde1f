"""FP8 in the blocks' linear layers: torchao's dynamic-activation, FP8-weight quantization, which
layers get it, the cuBLASLt shape it must avoid (`BiasAfterGEMM`), and row-wise scales where
cuBLAS has no row-wise scaled GEMM (`RowScalesAfterGEMM`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from aot.blocks import pre_hooks
from aot.options import FP8_GRANULARITIES

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
    """torchao's FP8 dynamic-activation, FP8-weight config at `granularity` (`options.FP8_GRANULARITIES`;
    "row-after" quantizes as "row"). Raises `ValueError` for another granularity.

    `set_inductor_config=False`: Inductor settings live in `INDUCTOR_CONFIGS`, not in a global
    that quantizing changes.
    """
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor  # heavy: at first use

    if granularity not in FP8_GRANULARITIES:
        raise ValueError(f"FP8 granularity {granularity!r}: use one of {', '.join(FP8_GRANULARITIES)}")
    return Float8DynamicActivationFloat8WeightConfig(
        granularity=PerTensor() if granularity == "tensor" else PerRow(), set_inductor_config=False
    )


def quantize_block_(block: torch.nn.Module, granularity: str, rows: dict[str, int] | None = None) -> tuple[int, int]:
    """Quantize the block's linear layers to FP8 at `granularity` (`options.FP8_GRANULARITIES`) with torchao, in place.

    Layers narrower than `FP8_MIN_FEATURES` or not 16-aligned stay as they are, and so do layers
    already quantized (so applying twice is harmless). At "row-after" every quantized layer becomes
    a `RowScalesAfterGEMM`. `rows`: each linear layer's fewest input rows in the block's captured
    calls, by its name in the block (`fewest_rows`); at "row", a quantized layer with a bias that saw
    at most `BIAS_AFTER_GEMM_ROWS` of them becomes a `BiasAfterGEMM` (none without `rows`: binding
    saved packages runs their graphs, not these layers). Returns (quantized, skipped) layer counts.
    Raises `ValueError` for an unknown granularity.
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
        quantize_(block, fp8_config(granularity), filter_fn=lambda m, _: id(m) in chosen)
        for name in eligible:
            few = rows is not None and rows.get(name, 0) <= BIAS_AFTER_GEMM_ROWS  # no captured call: unknown, so few
            if granularity == "row-after":
                RowScalesAfterGEMM.adopt_(linears[name])
            elif granularity == "row" and few and linears[name].bias is not None:
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


class RowScalesAfterGEMM(torch.nn.Linear):
    """A row-wise FP8 layer for GPUs whose cuBLAS scales FP8 only per tensor (sm_120, sm_89).

    cuBLAS has no row-wise scaled FP8 GEMM on sm_120: `torch._scaled_mm` with row-wise scales
    returns `CUBLAS_STATUS_NOT_SUPPORTED` there (pytorch#192707, #161236; sm_89 has none either).
    This layer keeps torchao's row-wise weight (FP8 values, a scale per output channel) and
    torchao's activation quantization (a scale per row: its abs-max / 448), runs the GEMM with unit
    per-tensor scales, and multiplies the bf16 product by each row's and column's scale afterwards,
    where Inductor fuses the product, the bias and the cast into the kernel that reads the GEMM's
    output. Its FP8 values are row-wise FP8's; the result differs from cuBLAS's row-wise epilogue by
    a second bf16 rounding of the product and by the column scales' rounding to bf16 (below)
    (tests/test_fp8.py and tests/test_gpu.py bound both), and an all-zero row gives the bias where
    torchao's scale of 0 gives NaN. Same parameters and names as the `nn.Linear` it replaces, and a
    buffer `unit`; input (..., in_features), bf16 as torchao's row-wise weights are; output
    (..., out_features) of the input's dtype. The product is kept in bf16, whose range holds
    it (up to 448 x 448 x in_features), where fp16's would not.

    The GEMM's unit scales are a buffer of the layer (`unit`, 0-d float32), bound to the package as
    its weights are: a `torch.ones(())` in the graph is a kernel of its own before every GEMM (494 a
    FLUX.1-dev step). Inductor turns a 0-d constant into a number and gives an extern kernel's tensor
    argument a new constant of its own name, which no block has; `lowering.FP8_INDUCTOR_CONFIGS` keeps
    it a tensor under its name for `row-after` packages.

    The column scales are held in bf16, not float32: the kernel after the GEMM reads all of them
    for every row, and in bf16 FLUX.1-dev's step took 96.6 against 97.4 ms (H100, 2026-12-06,
    BENCHMARKS.md). bf16 rounds a scale by at most 2^-9 of it, 1/32 of what e4m3 rounds a weight by
    (2^-4).
    """

    @classmethod
    def adopt_(cls, layer: torch.nn.Linear) -> None:
        """Make `layer`, a linear layer torchao quantized row-wise, this class in place, with its
        `unit` buffer (persistent, so that `blocks.block_constants` binds it) and its weight's scales
        in bf16 (lora.py's in-place writes cast to them)."""
        layer.__class__ = cls
        layer.register_buffer("unit", torch.ones((), dtype=torch.float32, device=layer.weight.device))
        layer.weight.scale = layer.weight.scale.to(torch.bfloat16)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8  # heavy

        weight = self.weight  # torchao's Float8Tensor: qdata (out, in) FP8, scale (out, 1) bf16 (`adopt_`)
        kind = weight.act_quant_kwargs  # how torchao quantizes this layer's activations
        block_size = [1] * (input.dim() - 1) + [self.in_features]  # torchao's name: one scale per row
        bounds = {"hp_value_lb": kind.hp_value_lb, "hp_value_ub": kind.hp_value_ub}
        scale = _choose_scale_float8(input, block_size, kind.float8_dtype, **bounds)  # float32 (..., 1)
        scale = scale.clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero row: 0 / tiny, not 0 / 0
        data = _quantize_affine_float8(input, scale, kind.float8_dtype)
        product = torch._scaled_mm(
            data.reshape(-1, self.in_features),
            weight.qdata.t(),
            scale_a=self.unit,
            scale_b=self.unit,
            out_dtype=torch.bfloat16,
            use_fast_accum=weight.mm_config.use_fast_accum,
        ).reshape(*input.shape[:-1], self.out_features)
        output = product * (scale * weight.scale.reshape(-1))  # float32: (..., 1) x (out,)
        if self.bias is not None:
            output = output + self.bias
        return output.to(input.dtype)

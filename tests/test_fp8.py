"""FP8 linear layers on the CPU: which layers `quantize_block_` quantizes and swaps at each granularity,
`BiasAfterGEMM`, and `RowScalesAfterGEMM`'s arithmetic and exported graph (tests/test_gpu.py runs them
on a GPU, inside compiled blocks)."""

import pytest
import torch
from torchao.quantization import Float8Tensor, PerRow

from aot.fp8 import BIAS_AFTER_GEMM_ROWS, BiasAfterGEMM, RowScalesAfterGEMM, fewest_rows, quantize_block_
from aot.options import FP8_GRANULARITIES


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """Stand-in for a GPU of compute capability 8.9 or more: torchao refuses to quantize without one
    (`_check_hardware_support`), though what it guards, the scales and the cast, is torch ops a CPU runs.
    Only that check is replaced; torchao's quantization and torch's `_scaled_mm` (per-tensor scales run on
    a CPU; row-wise ones do not, as on sm_120) are real."""
    from torchao.quantization import quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)


def _block() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        {
            "text": torch.nn.Linear(256, 512),  # a bias, few rows
            "image": torch.nn.Linear(512, 256),  # a bias, many rows
            "gate": torch.nn.Linear(256, 256, bias=False),
            "narrow": torch.nn.Linear(64, 256),  # under FP8_MIN_FEATURES: stays bf16
        }
    ).to(torch.bfloat16)


@pytest.mark.parametrize(
    ("granularity", "expected"),
    [
        ("row", {"text": BiasAfterGEMM, "image": torch.nn.Linear, "gate": torch.nn.Linear}),
        ("row-after", {"text": RowScalesAfterGEMM, "image": RowScalesAfterGEMM, "gate": RowScalesAfterGEMM}),
        ("tensor", {"text": torch.nn.Linear, "image": torch.nn.Linear, "gate": torch.nn.Linear}),
    ],
)
def test_each_granularity_quantizes_the_wide_layers_and_swaps_the_ones_it_must(fp8_on_cpu, granularity, expected):
    block = _block()
    rows = {"text": 14, "image": 4096, "gate": 4096}
    assert quantize_block_(block, granularity, rows) == (3, 1)
    assert {name: type(block[name]) for name in expected} == expected
    assert all(isinstance(block[name].weight, Float8Tensor) for name in expected)
    assert type(block["narrow"]) is torch.nn.Linear and type(block["narrow"].weight) is torch.nn.Parameter
    scales = {tuple(block[name].weight.scale.shape) for name in expected}
    assert scales == ({(1, 1)} if granularity == "tensor" else {(512, 1), (256, 1)}), scales
    assert quantize_block_(block, granularity, rows) == (0, 1)  # applied twice: nothing left to quantize


def test_an_unknown_granularity_is_refused_with_the_ones_allowed():
    with pytest.raises(ValueError, match="'col'.*" + ", ".join(FP8_GRANULARITIES)):
        quantize_block_(_block(), "col")


def _quantized_layer(granularity: str = "row-after") -> torch.nn.Linear:
    """A layer quantized at `granularity` ("row-after"; "row" gives its twin with torchao's float32
    scales) whose output channels' weights span four orders of magnitude (one weight scale for all of
    them would flush the small ones)."""
    torch.manual_seed(0)
    layer = torch.nn.ModuleDict({"layer": torch.nn.Linear(256, 512)})
    with torch.no_grad():
        layer["layer"].weight.mul_(10.0 ** torch.linspace(-2, 2, 512).reshape(512, 1))
    quantize_block_(layer.to(torch.bfloat16), granularity)
    return layer["layer"]


def _rows_of_every_scale(*leading: int) -> torch.Tensor:
    """Activations (*leading, 256) whose rows span 12 orders of magnitude (one scale for all of them
    would flush the small rows to zero), the first row all zeros."""
    torch.manual_seed(1)
    rows = torch.Size(leading).numel()
    magnitudes = 10.0 ** torch.linspace(-6, 6, rows).reshape(*leading, 1)
    x = torch.randn(*leading, 256) * magnitudes
    x.view(-1, 256)[0] = 0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("leading", [(96,), (2, 96), (2, 3, 32)])
def test_row_scales_after_the_gemm_give_row_wise_fp8s_result_on_every_row(fp8_on_cpu, leading):
    """Against the same FP8 values with torchao's float32 scales, dequantized by torchao and multiplied
    in float32: each row and column within the output's bf16 rounding (two roundings here: the
    product's, then the scaled result's) and the column scales' own (bf16); the zero row gives the bias."""
    layer, twin = _quantized_layer(), _quantized_layer("row")
    assert torch.equal(layer.weight.qdata, twin.weight.qdata) and layer.weight.scale.dtype == torch.bfloat16
    assert torch.equal(layer.weight.scale, twin.weight.scale.to(torch.bfloat16))
    x = _rows_of_every_scale(*leading)
    output = layer(x)
    assert output.dtype == torch.bfloat16 and output.shape == (*leading, 512)
    output, x = output.reshape(-1, 512), x.reshape(-1, 256)
    assert torch.equal(output[0], layer.bias)
    activation = Float8Tensor.from_hp(x[1:], granularity=PerRow())  # torchao's quantization, as the layer's
    reference = activation.dequantize().float() @ twin.weight.dequantize().float().t() + layer.bias.float()
    norms = reference.norm(dim=1, keepdim=True)  # each row to unit norm, so that no row outweighs the rest
    error, reference = (output[1:].float() - reference) / norms, reference / norms
    per_row, per_channel = error.norm(dim=1), error.norm(dim=0) / reference.norm(dim=0)
    assert per_row.max() < 1e-2 and per_channel.max() < 1e-2, (per_row.max(), per_channel.max())


def test_row_scales_after_the_gemm_export_as_a_per_tensor_gemm_then_the_scales(fp8_on_cpu):
    """The exported graph has one `_scaled_mm`, with 0-d (per-tensor) scales and no bias, which cuBLAS
    runs on sm_120; the row and column scales and the bias come after it, where Inductor fuses them into
    the next kernel. The exported program gives the eager layer's result at a token count it was not
    traced with."""
    layer = _quantized_layer()
    x = _rows_of_every_scale(2, 96)
    with torch.no_grad():
        program = torch.export.export(layer, (x,), dynamic_shapes=({1: torch.export.Dim("tokens", min=16, max=4096)},))
    nodes = list(program.graph.nodes)
    (gemm,) = [n for n in nodes if n.target == torch.ops.aten._scaled_mm.default]
    scale_a, scale_b = gemm.args[2:4]
    assert scale_a.meta["val"].dim() == 0 and scale_b.meta["val"].dim() == 0
    assert program.graph_signature.inputs_to_buffers[scale_a.name] == "unit" and scale_b is scale_a  # bound, not made
    assert len(gemm.args) < 5 or gemm.args[4] is None  # no bias in the GEMM
    after = nodes[nodes.index(gemm) :]
    assert sum(n.target == torch.ops.aten.mul.Tensor for n in after) >= 2
    assert any(n.target == torch.ops.aten.add.Tensor for n in after)
    other = _rows_of_every_scale(2, 48)
    torch.testing.assert_close(program.module()(other), layer(other), rtol=0, atol=0)


def test_a_row_after_package_asks_for_the_layers_unit_scale_by_its_name(fp8_on_cpu):
    """A package compiled with `FP8_INDUCTOR_CONFIGS["row-after"]` reads the GEMM's unit scales from the
    layer's `unit` buffer, so binding the layer gives it them; with Inductor's defaults (what "row" packages
    get) the package asks for constants of its own naming, which no block has. A CPU's AOTInductor cannot
    compile the layer's FP8 casts, so the package holds the layer's GEMM alone, called as the layer calls
    it; tests/test_gpu.py compiles and binds whole row-after blocks."""
    from aot import lowering
    from aot.runner import bind, load_runner

    layer = _quantized_layer()

    class GEMM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, data: torch.Tensor) -> torch.Tensor:
            unit = self.layer.unit
            return torch._scaled_mm(data, self.layer.weight.qdata.t(), unit, unit, out_dtype=torch.bfloat16)

    gemm, data = GEMM(), torch.randn(96, 256).to(torch.float8_e4m3fn)
    with torch.no_grad():
        program = torch.export.export(gemm, (data,))
    default = load_runner(lowering.compile_package(program, "row")).get_constant_fqns()
    assert "layer.unit" not in default and len(default) == 3, default  # the weight and two made-up scalars
    runner, constants = bind(lowering.compile_package(program, "row-after"), gemm)
    assert sorted(constants) == ["layer.parametrizations.weight.original0", "layer.unit"]
    assert constants["layer.unit"] is layer.unit
    assert torch.equal(runner(data), gemm(data))


def test_a_lora_written_into_a_row_after_layer_keeps_its_scales_bf16_and_the_base_comes_back_exactly(fp8_on_cpu):
    """lora.py writes a LoRA into an FP8 layer in place (dequantize, add, quantize again, `copy_` into
    the layer's tensors): into a row-after layer that cast gives bf16 scales, the ones its package was
    compiled for, and the weight is the row-wise twin's within those scales' rounding. Writing no LoRA
    brings the base back bit for bit."""
    from aot import lora
    from aot.fp8 import fp8_config

    torch.manual_seed(2)
    a, b = torch.randn(4, 256) * 1e-2, torch.randn(512, 4) * 1e-2  # rank 4: A [r, in], B [out, r]
    layers = {granularity: _quantized_layer(granularity) for granularity in ("row", "row-after")}
    bases = {g: {n: t.clone() for n, t in lora.inner_tensors(layer.weight).items()} for g, layer in layers.items()}
    for granularity, layer in layers.items():
        lora._write(layer, bases[granularity], (a, b, 2.0), fp8_config(granularity))
    after = layers["row-after"]
    assert after.weight.scale.dtype == torch.bfloat16
    weight, twin = after.weight.dequantize().float(), layers["row"].weight.dequantize().float()
    torch.testing.assert_close(weight, twin, rtol=2**-8, atol=0)
    lora._write(after, bases["row-after"], None, fp8_config("row-after"))
    assert all(torch.equal(t, bases["row-after"][n]) for n, t in lora.inner_tensors(after.weight).items())


def test_a_row_wise_layer_adds_its_bias_after_its_gemm():
    """`BiasAfterGEMM` (what `quantize_block_` makes a row-wise FP8 layer with a bias that saw few rows):
    the same result and parameter names as the `nn.Linear` it was, and its exported graph calls the GEMM
    without the bias. A bf16 layer stands in for the FP8 one: row-wise scaled FP8 does not run on a CPU;
    tests/test_gpu.py runs the FP8 layer cuBLASLt refused."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    reference = linear(x)
    linear.__class__ = BiasAfterGEMM
    torch.testing.assert_close(linear(x), reference)
    assert [name for name, _ in linear.named_parameters()] == ["weight", "bias"]
    graph = torch.export.export(linear, (x,)).graph
    (gemm,) = [n for n in graph.nodes if n.target == torch.ops.aten.linear.default]
    assert len(gemm.args) == 2  # input, weight: no bias
    assert any(n.target == torch.ops.aten.add.Tensor for n in graph.nodes)


def test_the_rows_each_linear_layer_saw_are_recorded_by_its_name_in_the_block():
    """`fewest_rows`: the GEMM's M (all but the input's last dim) per linear layer, the fewest over the
    calls made inside, by the layer's name in the block; what decides `BiasAfterGEMM`."""
    block = torch.nn.ModuleDict({"image": torch.nn.Linear(8, 8), "text": torch.nn.Linear(8, 8)})
    with fewest_rows(block) as rows:
        for image, text in ((64, 14), (16, 300)):
            block["image"](torch.randn(2, image, 8))
            block["text"](input=torch.randn(text, 8))
    assert rows == {"image": 32, "text": 14}
    block["image"](torch.randn(1, 8))  # outside: not recorded, and the hooks are gone
    assert rows == {"image": 32, "text": 14} and not block["image"]._forward_pre_hooks
    assert rows["text"] <= BIAS_AFTER_GEMM_ROWS < 1024  # a short prompt's text; 512 px of image has 1024 tokens


def test_row_after_packages_compile_with_their_own_inductor_settings(monkeypatch):
    """`compile_package(fp8="row-after")` hands Inductor `FP8_INDUCTOR_CONFIGS["row-after"]` over
    `INDUCTOR_CONFIGS`; other granularities get `INDUCTOR_CONFIGS` alone. The real AOTInductor compile
    runs (on a CPU); the spy only records the settings it was given (their effect on a GPU's kernels:
    BENCHMARKS.md, "Row-wise FP8 where cuBLAS has none")."""
    from aot import lowering

    given = []
    compile_and_package = torch._inductor.aoti_compile_and_package

    def spy(exported, **kwargs):
        given.append(kwargs["inductor_configs"])
        return compile_and_package(exported, **kwargs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", spy)
    exported = torch.export.export(torch.nn.Linear(16, 16), (torch.randn(4, 16),))
    for fp8 in (None, "row", "row-after"):
        assert lowering.compile_package(exported, fp8)[:2] == b"PK"  # a package: a zip file
    thresholds = [settings["realize_opcount_threshold"] for settings in given]
    default = lowering.INDUCTOR_CONFIGS["realize_opcount_threshold"]
    row_after = lowering.FP8_INDUCTOR_CONFIGS["row-after"]["realize_opcount_threshold"]
    assert thresholds == [default, default, row_after] and row_after > default
    assert all(s.keys() >= lowering.INDUCTOR_CONFIGS.keys() for s in given)

"""FP8 rows made in row_fp8.py's Triton kernel, on a CPU: the kernel run by Triton's interpreter against its
torch reference, the kernel compiled ahead for the GPUs the plans serve, its refusals, and the graph
rewrite on FLUX's blocks quantized as the plans quantize them (the exported graph computes the same bits
with the op as without it). test_gpu.py runs the kernel on a GPU."""

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
import triton
from conftest import ROOT, load_tiny, tiny_options
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from aot import row_fp8
from aot.fp8 import quantize_block_
from aot.gelu import GELU_CUBE, SQRT_2_OVER_PI
from aot.lowering import DECOMPOSITIONS, decomposed
from aot.plans import PLANS, resolve_row_fp8

OP = torch.ops.aot_fp8.row_quantize.default
ROW_FP8 = frozenset({"row_fp8"})  # what `Trials.ours` holds where the kernel is on


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """Stand-in for a GPU of compute capability 8.9 or more: torchao refuses to quantize without one
    (`_check_hardware_support`), though what it guards, the scales and the cast, is torch ops a CPU runs.
    Only that check is replaced (as in test_fp8.py)."""
    from torchao.quantization import quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)


def rows(seed: int = 0):
    """Two parts of 2 x 7 rows: an attention output (96 wide, a view whose rows are 288 entries apart) and
    a GEMM's product (160 wide) with its row scales, bf16 column scales and bias; the first row all zeros."""
    torch.manual_seed(seed)
    attention = (torch.randn(2, 7, 3 * 96) * 3).bfloat16()[..., :96]
    product = (torch.randn(2, 7, 160) * 50).bfloat16()
    row_scale = torch.rand(2, 7, 1) * 0.1 + 0.01
    col_scale, bias = (torch.rand(160) + 0.5).bfloat16(), torch.randn(160).bfloat16()
    attention[0, 0], product[0, 0] = 0, 0
    return attention, product, row_scale, col_scale, bias


INTERPRETED = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from test_row_fp8 import rows
from aot import row_fp8
attention, product, r, c, b = rows()
cases = {
    "one part, GELU": (([product], [None], [None], [None], [True]), ([product], [None], [None], [None], [False])),
    "two parts, scaled": (
        ([attention, product], [None, r], [None, c], [None, b], [False, True]),
        ([attention, product], [None, r], [None, c], [None, b], [False, False]),
    ),
    "two parts, plain": (
        ([attention, product], [None] * 2, [None] * 2, [None] * 2, [False, False]),
        ([attention, product], [None] * 2, [None] * 2, [None] * 2, [False, True]),
    ),
}
found = {}
for name, (args, other) in cases.items():
    for floor in (False, True):
        data, scale = row_fp8.row_quantize(*args, floor)
        ref, ref_scale = row_fp8.reference(*args, floor)
        wrong, _ = row_fp8.reference(*other, floor)
        rows_ = ref_scale.isfinite().squeeze(-1) & (ref_scale > 0).squeeze(-1)  # the all-zero row aside
        bound = 2**-3 * ref.float().abs().amax(-1, keepdim=True)
        over = lambda t: ((t.float() - ref.float()).abs() > bound)[rows_].float().mean().item()
        zero = data[0, 0].float()
        found[f"{name} floor={floor}"] = [
            torch.equal(scale, ref_scale), over(data), over(wrong), list(data.shape), data.is_contiguous(),
            bool((zero == 0).all()) or not floor or ref_scale[0, 0].item() != 0,
        ]
x = (torch.rand(2, 112) + 1).bfloat16()  # a row scale of inf, a width no multiple of a program's chunk
args = ([x], [torch.tensor([[float("inf")], [0.5]])], [torch.ones(112).bfloat16()], [torch.zeros(112).bfloat16()])
scales = [f(*args, [False], True)[1] for f in (row_fp8.row_quantize, row_fp8.reference)]
found["infinite row scale"] = [torch.equal(*scales)]
print(json.dumps(found))
"""


def test_the_kernel_run_by_tritons_interpreter_matches_its_reference():
    """The kernel's code run on the CPU by Triton's interpreter (TRITON_INTERPRET=1, read when the module
    is imported: a process of its own): one part with its GELU, two parts with the second's scales and bias
    after its GEMM, two plain parts; rows that start 16 bytes into a wider tensor, an all-zero row. Each row's
    scale is the reference's to the bit (the kernel rounds to bf16 on the bits where the interpreter, which
    truncates, would not). Each FP8 entry is within one FP8 step (2^-3) of its row's largest (Triton 3.6's
    interpreter casts to FP8 toward zero where a GPU rounds to nearest, and up to 1% of them a binade too
    low here: sage's test says why), where the reference with a GELU taken away or added is beyond for many.
    An all-zero row is 0 where the scale is floored (`RowScalesAfterGEMM`); unfloored it is torchao's 0 / 0,
    NaN, which the interpreter casts to FP8 as a number (test_gpu.py checks it on a GPU). A row scale of inf
    gives the row the reference's scale, inf, where the entries past the row would have made it NaN."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", INTERPRETED, str(ROOT / "tests")]
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    assert len(found) == 7 and found.pop("infinite row scale") == [True]  # inf, not inf x 0 past the row
    for case, (same_scales, over, wrong, shape, contiguous, zero_row) in found.items():
        assert same_scales and over <= 0.02 and wrong > 0.1, (case, same_scales, over, wrong)
        assert shape == [2, 7, 160 if "one part" in case else 256] and contiguous and zero_row, case


def test_the_op_is_its_reference_on_a_cpu_and_refuses_what_the_kernel_cannot_read():
    """On a CPU the op computes its reference (the ops a package compiled for a CPU runs); tensors the
    kernel cannot take are refused with what is allowed."""
    attention, product, r, c, b = rows()
    args = ([attention, product], [None, r], [None, c], [None, b], [False, True], True)
    for got, expected in zip(row_fp8.row_quantize(*args), row_fp8.reference(*args), strict=True):
        assert torch.equal(got.float(), expected.float())
    cases = [
        (([attention.float()], [None], [None], [None], [True]), "each part must be .* torch.bfloat16"),
        (([attention, product[:1]], [None] * 2, [None] * 2, [None] * 2, [False] * 2), "leading dims must be alike"),
        (([product.transpose(0, 1)], [None], [None], [None], [True]), "one stride apart"),
        (([product], [r], [None], [None], [True]), "come together"),
        (([product], [None], [None], [b], [True]), "come together"),
        (([product], [r.bfloat16()], [c], [None], [True]), "row scale must be"),
        (([product], [r], [c[:8]], [None], [True]), "column scales and biases must be"),
        (([product] * 3, [None] * 3, [None] * 3, [None] * 3, [True] * 3), "one or two parts"),
        (([product], [r], [torch.tensor(1.0).bfloat16()], [None], [True]), "column scales and biases must be"),
        (([product, product[..., :0]], [None] * 2, [None] * 2, [None] * 2, [False] * 2), "an entry a row"),
        (([product[..., :8]], [None], [None], [None], [True]), "a multiple of 16 entries wide"),
    ]
    for case, message in cases:
        with pytest.raises(ValueError, match=message):
            row_fp8.row_quantize(*case)


def _compiled(capability: int, two: bool) -> str:
    """The kernel's PTX for compute capability `capability`, its arguments typed as a FLUX single block's
    package passes them at `row-after` (two parts, the second scaled with a bias and a GELU) or one part
    with a GELU: the pointers and row strides multiples of 16 (AOTInductor says so of the static ones)."""
    fn = row_fp8._row_fp8_kernel
    constants = {"SCALED1": False, "BIAS1": False, "GELU1": not two, "SCALED2": two, "BIAS2": two, "GELU2": two}
    constants.update(TWO=two, FLOORED=two, GPU=True, **row_fp8.CONFIG.kwargs)
    types = {name: "*bf16" for name in ("X1", "X2", "C1", "C2", "B1", "B2")}
    types.update(R1="*fp32", R2="*fp32", Out="*fp8e4nv", Scale="*fp32")
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
    divisible = [n for n in fn.arg_names if n in types or n.startswith(("stride", "width"))]
    source = ASTSource(
        fn,
        signature,
        constexprs={(fn.arg_names.index(n),): v for n, v in constants.items()},
        attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible},
    )
    options = {"num_warps": row_fp8.CONFIG.num_warps}
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options).asm["ptx"]


@pytest.mark.parametrize("capability", [90, 120])
def test_the_kernel_compiles_for_hopper_and_zerogpus_card(capability):
    """Triton compiles the kernel ahead for GPUs this machine does not have (ptxas ships with it). The rows
    load 16 bytes a thread (8 bf16 entries) and store the FP8 rows 8 bytes a thread; the GELU's tanh is the
    GPU's `tanh.approx.f32`, as Inductor's GELU computes it (`gelu.TANH_APPROX_PTX`); nothing is in fp64;
    the abs-max and the clamp keep NaN (PTX's `.NaN` max and min)."""
    for two in (False, True):
        ptx = _compiled(capability, two)
        loads = Counter(re.findall(r"ld\.global[\w.]*", ptx))
        # each part's x, and the second's column scales and bias, in each of the two reads; its row scale once each
        assert loads == ({"ld.global.v4.b32": 8, "ld.global.b32": 2} if two else {"ld.global.v4.b32": 2}), loads
        assert set(re.findall(r"st\.global[\w.]*", ptx)) == {"st.global.v2.b32", "st.global.b32"}  # rows, a scale
        assert len(re.findall(r"tanh\.approx\.f32", ptx)) >= 2  # the GELU's, in each read of the row
        assert not re.search(r"\b(mul|fma|add|sub|div)[\w.]*\.f64", ptx)
        assert {"max.NaN.f32", "min.NaN.f32"} <= set(re.findall(r"\b(?:max|min)[\w.]*\.f32", ptx))


def flux_block(kind: str, granularity: str):
    """FLUX's single or double block at 256 features (2 heads of 128: wide enough for FP8), bf16, its
    linear layers quantized at `granularity` as the plans quantize them, exported with SDPA on random
    inputs: (the exported program, those inputs, the module exported)."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    torch.manual_seed(0)
    cls = FluxSingleTransformerBlock if kind == "single" else FluxTransformerBlock
    block = cls(dim=256, num_attention_heads=2, attention_head_dim=128).to(torch.bfloat16)
    quantize_block_(block, granularity)

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, image, text, temb, cos, sin):
            return self.block(image, text, temb, (cos, sin))

    inputs = (
        torch.randn(1, 64, 256, dtype=torch.bfloat16),
        torch.randn(1, 16, 256, dtype=torch.bfloat16),
        torch.randn(1, 256, dtype=torch.bfloat16),
        torch.randn(80, 128),
        torch.randn(80, 128),
    )
    module = Call()
    with torch.no_grad():
        return torch.export.export(module, inputs), inputs, module


def calls(program: torch.export.ExportedProgram) -> Counter:
    return Counter(node.target for node in program.graph.nodes if node.op == "call_function")


@pytest.mark.parametrize("granularity", ["row", "row-after"])
def test_flux_blocks_make_their_gelu_and_cat_rows_in_the_kernel(fp8_on_cpu, granularity):
    """In FLUX's single block the `proj_out` input, `cat([attention, gelu(mlp)], -1)`, and in its double
    block each stream's MLP output input, `gelu(mlp)`, become one call each: the GELU's ops are gone and the
    `cat` too; the other quantizations (the norms' outputs, attention's) stay Inductor's. At `row-after`
    the MLP's scales and bias after its GEMM come into the call, and the scale is floored as
    `RowScalesAfterGEMM` divides; the graph computes the same bits as before (a CPU runs `row-after`'s
    per-tensor GEMMs; not `row`'s)."""
    after = granularity == "row-after"
    for kind, sites in (("single", 1), ("double", 2)):
        program, inputs, _ = flux_block(kind, granularity)
        plain = program.run_decompositions(DECOMPOSITIONS)
        fused = decomposed(program, ROW_FP8)
        found, before = calls(fused), calls(decomposed(program))
        assert found[OP] == sites and not found[torch.ops.aot_lowering.tanh_approx.default], kind
        assert found[torch.ops.aten.cat.default] == before[torch.ops.aten.cat.default] - (kind == "single")
        scales = [count for target, count in found.items() if str(target) == "torchao.choose_scale_float8.default"]
        unfused = [count for target, count in before.items() if str(target) == "torchao.choose_scale_float8.default"]
        assert scales == [unfused[0] - sites], kind
        for node in [n for n in fused.graph.nodes if n.target is OP]:
            xs, row_scales, _, biases, gelu, floor = node.args
            assert gelu[-1] and floor is after and (row_scales[-1] is not None) is after
            assert (biases[-1] is not None) is after and len(xs) == (2 if kind == "single" else 1)
        if after:
            expected, got = plain.module()(*inputs), fused.module()(*inputs)
            expected, got = (t if isinstance(t, tuple) else (t,) for t in (expected, got))
            assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), kind
        assert before[OP] == 0  # off unless asked


def test_what_only_looks_like_a_site_is_left_as_it_is(fp8_on_cpu):
    """Rows quantized per tensor (not row-wise), an exact (erf) GELU's output, and a GELU's output that
    something else reads too are torchao's and Inductor's as before; the tanh GELU's output read by its FP8
    rows alone is taken (the control)."""
    program, *_ = flux_block("single", "tensor")
    assert calls(decomposed(program, ROW_FP8))[OP] == 0

    class MLP(torch.nn.Module):
        def __init__(self, approximate: str, shared: bool):
            super().__init__()
            self.up, self.down = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)
            self.approximate, self.shared = approximate, shared

        def forward(self, x):
            gelu = torch.nn.functional.gelu(self.up(x), approximate=self.approximate)
            return self.down(gelu) + (gelu[..., :256] if self.shared else 0)

    for approximate, shared, taken in (("none", False, 0), ("tanh", True, 0), ("tanh", False, 1)):
        module = MLP(approximate, shared).to(torch.bfloat16)
        quantize_block_(module, "row-after")
        with torch.no_grad():
            program = torch.export.export(module, (torch.randn(1, 24, 256, dtype=torch.bfloat16),))
        assert calls(decomposed(program, ROW_FP8))[OP] == taken, (approximate, shared)


class Rows(torch.nn.Module):
    """torchao's row-wise quantization of what `make` computes, written out (no GEMM, so a CPU runs any
    granularity): the FP8 rows as float32, and the scales."""

    def __init__(self, make, floor: bool = True, **bounds):
        super().__init__()
        self.make, self.floor, self.bounds = make, floor, bounds

    def forward(self, *inputs):
        from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

        x = self.make(*inputs)
        scale = _choose_scale_float8(x, [1] * (x.dim() - 1) + [x.shape[-1]], torch.float8_e4m3fn, **self.bounds)
        divisor = scale.clamp(min=row_fp8.FLOOR) if self.floor else scale
        return _quantize_affine_float8(x, divisor, torch.float8_e4m3fn).float(), scale


def test_the_rewrite_takes_only_what_the_kernel_computes():
    """Sites written out by hand: what the rewrite takes gives the same bits as before (a CPU runs the op's
    reference); it leaves what the kernel would compute otherwise: bounds on the abs-max (torchao's
    `hp_value_lb`, `hp_value_ub`, given by position as export records them), another scale dtype, an add
    with an `alpha`, and a SymInt where a bias would be (which must not crash it)."""
    from aot.lowering import DECOMPOSITIONS
    from aot.row_fp8_sites import fuse_row_fp8

    tanh = torch.ops.aot_lowering.tanh_approx
    attention, product, r, c, b = rows()
    gelu = lambda t: torch.nn.functional.gelu(t, approximate="tanh")  # noqa: E731

    def gelu_with_alpha(y):  # `lowering.gelu_tanh_approx`'s ops, 1 + tanh written with alpha=2
        f = y.float()
        return (f * 0.5 * torch.add(tanh((f + f * GELU_CUBE * f * f) * SQRT_2_OVER_PI), 1, alpha=2)).bfloat16()

    scaled = lambda a, p, r, c, b: torch.cat([a, gelu((p * (r * c) + b).bfloat16())], -1)  # noqa: E731
    thrice = lambda t, b: torch.add(t, b, alpha=3).bfloat16()  # noqa: E731  # read as a plain part
    inputs = (attention, product, r, c, b)
    cases = {
        "scaled and joined": (Rows(scaled), inputs, 1),
        "unfloored": (Rows(scaled, floor=False), inputs, 1),
        "a bound on the abs-max": (Rows(scaled, hp_value_ub=1.0), inputs, 0),
        "a lower bound": (Rows(scaled, hp_value_lb=8.0), inputs, 0),
        "scales in e8m0": (Rows(scaled, scale_dtype=torch.float8_e8m0fnu), inputs, 0),
        "a bias added 3 times": (Rows(lambda a, p, r, c, b: torch.cat([a, thrice(p * (r * c), b)], -1)), inputs, 1),
        "a GELU with alpha": (Rows(gelu_with_alpha), (product,), 0),
    }
    for name, (module, args, taken) in cases.items():
        with torch.no_grad():
            program = torch.export.export(module, args).run_decompositions(DECOMPOSITIONS)
            expected = program.module()(*args)
            assert (fuse_row_fp8(program.graph_module), name) == (taken, name)
            got = program.module()(*args)
        assert all(torch.equal(e.nan_to_num(7.0), g.nan_to_num(7.0)) for e, g in zip(expected, got, strict=True)), name
    symbolic = Rows(lambda a, p, r, c: torch.cat([a, gelu((p * (r * c) + p.shape[1]).bfloat16())], -1))
    seq = torch.export.Dim("seq", min=2, max=512)
    shapes = ({1: seq}, {1: seq}, {1: seq}, None)
    with torch.no_grad():
        program = torch.export.export(symbolic, inputs[:4], dynamic_shapes=(shapes,))
    # taken: the GELU's rows, the part read as Inductor computes it with the SymInt
    assert fuse_row_fp8(program.run_decompositions(DECOMPOSITIONS).graph_module) == 1


def test_no_plan_takes_the_kernel_yet_and_on_or_off_is_as_asked():
    """No plan takes the kernel until its step is measured on a GPU; `row_fp8=on` takes it on any GPU."""
    plans = {plan.name: plan for *_, plan in PLANS}
    assert not any(plan.row_fp8 for plan in plans.values())
    decision = resolve_row_fp8(tiny_options(), plans["sm_90"])
    assert decision.value == "off"
    assert decision.reason == "auto: plan sm_90 leaves the FP8 rows of a cat or a GELU to Inductor"
    assert resolve_row_fp8(tiny_options(row_fp8="on"), plans["sm_120"]).value == "on"
    assert resolve_row_fp8(tiny_options(row_fp8="off"), plans["sm_90"]).value == "off"


def test_packages_with_and_without_the_kernel_are_told_apart():
    """A set compiled with the kernel gets a variant name of its own and a fingerprint that differs; without
    it the fingerprint has no key for it, so sets saved before the kernel existed still match."""
    from aot.fingerprint import differences, fingerprint, variant
    from aot.target import Target

    pipe = load_tiny()
    resolution = Target.of(pipe, tiny_options()).resolution
    on, off = (fingerprint(pipe.transformer, resolution, "sdpa", "off", None, o) for o in (ROW_FP8, frozenset()))
    assert (variant(on), variant(off)) == ("sdpa-float32-rowfp8-512-1536", "sdpa-float32-512-1536")
    assert "row_fp8" not in off and differences(off, on) == ["row_fp8: None (packages) vs on (here)"]

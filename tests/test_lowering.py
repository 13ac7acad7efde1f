"""aot/lowering.py on the CPU: the heuristic and the decomposition every package compiles with."""

import copy
import re
import tempfile
import threading
from typing import Any

import pytest
import sympy
import torch
import torch.nn.functional as F
from conftest import TOLERANCE
from torch._inductor.choices import InductorChoices
from torch._inductor.exc import InductorError
from torch._inductor.graph import GraphLowering
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

from aot import lowering, rotations
from aot.blocks import rel_error
from aot.gelu import gelu_tanh_approx, tanh_approx
from aot.lowering import compile_package, decomposed
from aot.runner import bind

aten = torch.ops.aten


class Row:
    """Stands in for the kernel features Inductor passes its choices (what the heuristics read), at
    FLUX's widths and hints, which no small graph gives; `RowNorm` below has Inductor pass its own."""

    def __init__(self, width: int | sympy.Symbol, hint: ReductionHint = ReductionHint.INNER, reductions: tuple = ()):
        self.reduction_numel, self.hint = sympy.sympify(width), hint
        self.numel = 4608 * self.reduction_numel  # FLUX.1-dev's 4608 image tokens at 1024x1024
        self.reductions = reductions  # each reduction node's own hint
        self.node_schedule: list = []  # no nodes, so no reads: `persistent_rows` finds no contiguous row

    def is_reduction(self) -> bool:
        return True

    def scheduler_nodes(self) -> list:
        return self.node_schedule

    def get_reduction_hint(self) -> ReductionHint:
        return self.hint

    def reduction_nodes(self) -> list[int]:
        return list(range(len(self.reductions)))

    def reduction_hint(self, node: int) -> ReductionHint:
        return self.reductions[node]


def strided(width: int) -> Row:
    """The q and k kernel's features: two reductions along rows (sums of squares), hint DEFAULT (RoPE)."""
    return Row(width, ReductionHint.DEFAULT, (ReductionHint.INNER, ReductionHint.INNER))


def test_rows_up_to_16384_wide_stay_in_one_program_and_inductor_answers_otherwise():
    ours, inductors = lowering.persistent_rows(), InductorChoices()
    with V.set_graph_handler(GraphLowering(torch.fx.symbolic_trace(torch.nn.Identity()))):
        for width in (128, 1024, 3072, 4096, 12288, 15360, 16384):
            assert ours.should_use_persistent_reduction(Row(width), False), width
        assert not inductors.should_use_persistent_reduction(Row(3072), False)  # so the heuristic changed
        with torch._inductor.config.patch({"triton.persistent_reductions": False}):
            assert not ours.should_use_persistent_reduction(Row(3072), False)
        for row, cooperative in [
            (Row(16385), False),
            (Row(18432), False),  # FLUX.2 dev's SwiGLU rows
            (Row(64, ReductionHint.OUTER), False),
            (Row(3072, ReductionHint.DEFAULT), False),
            (Row(3072), True),
            (Row(sympy.Symbol("s0", integer=True, positive=True)), False),  # a width known at run time
        ]:
            expected = inductors.should_use_persistent_reduction(row, cooperative)
            assert ours.should_use_persistent_reduction(row, cooperative) == expected, (row.reduction_numel, row.hint)


def test_the_tanh_gelu_is_torchs_own_formula_with_tanh_as_an_op_of_its_own():
    x = torch.cat([torch.linspace(-12, 12, 24001), torch.tensor([-1e30, -1e4, -88.0, 0.0, 88.0, 1e4, 1e30])])
    torchs = F.gelu(x, approximate="tanh")
    ours = gelu_tanh_approx(x, approximate="tanh")
    assert ours.dtype == torch.float32
    # Eager, `tanh_approx` is torch.tanh: torch's formula up to float32 rounding (the order of the
    # products), that is within 2 ulp of the result's magnitude and 2e-7 of x near 0.
    assert torch.allclose(ours, torchs, rtol=2.5e-7, atol=2e-7)
    for dtype in (torch.bfloat16, torch.float64):  # computed in float32 or wider, returned as given
        out = gelu_tanh_approx(x.to(dtype), "tanh")
        assert out.dtype == dtype
        assert torch.allclose(out, F.gelu(x.to(dtype), approximate="tanh"), rtol=torch.finfo(dtype).eps, atol=2e-7)
    assert gelu_tanh_approx(x) is NotImplemented  # the exact (erf) GELU is left as it is
    # The op itself, eager: torch.tanh, any shape and dtype, and its fake (what export traces) agrees.
    assert tanh_approx(x.view(2, -1)).shape == (2, x.numel() // 2)
    assert torch.equal(tanh_approx(x), torch.tanh(x))
    for sample in (x.bfloat16(), torch.arange(-3, 4)):
        torch.library.opcheck(tanh_approx, (sample,))
    assert tanh_approx(torch.arange(-3, 4)).dtype == torch.get_default_dtype()


def test_decomposed_rewrites_tanh_gelus_only_and_keeps_the_programs_weights_and_inputs():
    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32, dtype=torch.bfloat16)

        def forward(self, x):
            return F.gelu(self.proj(x), approximate="tanh") * F.gelu(x)

    module, x = Both(), torch.randn(8, 32, dtype=torch.bfloat16)
    exported = torch.export.export(module, (x,), dynamic_shapes=({0: torch.export.Dim("rows", min=2, max=64)},))
    program = decomposed(exported)
    gelus = [node for node in program.graph.nodes if node.target is aten.gelu.default]
    assert len(gelus) == 1 and gelus[0].kwargs.get("approximate", "none") == "none"
    assert any(node.target is torch.ops.aot_lowering.tanh_approx.default for node in program.graph.nodes)
    # What a package is bound and called by: the weights' names, the inputs, the dynamic range.
    assert program.state_dict.keys() == exported.state_dict.keys()
    assert program.graph_signature.user_inputs == exported.graph_signature.user_inputs
    assert [str(r) for r in program.range_constraints.values()] == [str(r) for r in exported.range_constraints.values()]
    x = torch.randn(40, 32, dtype=torch.bfloat16)  # another row count in the range
    assert rel_error(program.module()(x), module(x)) < 1e-2  # bfloat16 rounding of the product
    erf_only = torch.export.export(torch.nn.GELU(), (x,))
    assert decomposed(erf_only) is erf_only  # no re-trace where nothing is rewritten


def test_a_package_compiles_the_decomposed_program_under_the_row_choices(monkeypatch):
    """Spies on the real Inductor calls: which program AOTInductor is given, and which choices
    handler a CPU lowering consults (it asks about fusions there, not about persistent reductions)."""
    programs, seen = [], []
    compile_real = torch._inductor.aoti_compile_and_package
    monkeypatch.setattr(
        torch._inductor,
        "aoti_compile_and_package",
        lambda program, **kwargs: programs.append(program) or compile_real(program, **kwargs),
    )
    ours = lowering.persistent_rows()
    fuse_real = ours.can_fuse
    monkeypatch.setattr(ours, "can_fuse", lambda *args: seen.append(V.choices) or fuse_real(*args))
    module = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 64), torch.nn.GELU("tanh")).eval()
    x = torch.randn(4, 64)
    runner, _ = bind(compile_package(torch.export.export(module, (x,))), module)
    (program,) = programs
    assert not any(node.target is aten.gelu.default for node in program.graph.nodes)
    assert seen and all(handler is ours for handler in seen) and V.choices is not ours
    assert rel_error(runner(x), module(x)) < TOLERANCE


def test_strided_rows_stay_in_one_program_and_other_rows_launch_as_inductor_chooses():
    from torch._inductor.codegen.triton import TritonKernel

    ours = lowering.persistent_rows()
    with V.set_graph_handler(GraphLowering(torch.fx.symbolic_trace(torch.nn.Identity()))):
        assert ours.should_use_persistent_reduction(strided(128), False)
        assert not InductorChoices().should_use_persistent_reduction(strided(128), False)  # so the heuristic changed
        for row in [
            strided(lowering.STRIDED_ROW_MAX * 2),  # persistent, Inductor's launch candidates
            Row(128),  # INNER: Inductor's own configurations
            Row(128, ReductionHint.DEFAULT, (ReductionHint.INNER, ReductionHint.OUTER)),
            Row(128, ReductionHint.DEFAULT),  # no reduction node
        ]:
            assert "fixed_config" not in ours.triton_kernel_kwargs(TritonKernel, row, [], {}), row.hint
        assert ours.should_use_persistent_reduction(strided(lowering.STRIDED_ROW_MAX * 2), False)
        with torch._inductor.config.patch({"triton.persistent_reductions": False}):
            assert "fixed_config" not in ours.triton_kernel_kwargs(TritonKernel, strided(128), [], {})


class RowNorm(torch.nn.Module):
    """RMS-normalizes each 128-wide row of `x * scale` and adds every other entry of `offsets`: one
    persistent reduction with a load strided along the row, a strided row (`persistent_rows`). A
    `scale` of one value per row, (rows, 1), is a load indexed by the row alone; a 0-d one is not."""

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        n = x.float() * scale
        return (n * torch.rsqrt(n.pow(2).mean(-1, keepdim=True) + 1e-6) + offsets[:, 0]).to(torch.bfloat16)


def row_norm(scale: torch.Tensor) -> torch.export.ExportedProgram:
    """`RowNorm` exported with its rows dynamic, as a package's image tokens are."""
    rows = torch.export.Dim("rows", min=16, max=4096)
    inputs = (torch.randn(256, 128, dtype=torch.bfloat16), torch.randn(128, 2), scale)
    return torch.export.export(RowNorm(), inputs, dynamic_shapes=({0: rows}, None, {0: rows} if scale.dim() else None))


def written_on_a_cpu(compile_: Any, *args: Any, **kwargs: Any) -> str:
    """Run `compile_(*args, **kwargs)` with Inductor writing Triton kernels for CPU tensors
    (`cpu_backend="triton"`), as it writes them for a GPU's; returns the error it ended with. This
    machine has no GPU driver, so Triton's compile stops it once the first kernel is written
    ("0 active drivers")."""
    with torch._inductor.config.patch(cpu_backend="triton"), pytest.raises(InductorError) as raised:
        compile_(*args, **kwargs)
    return str(raised.value)


# Where a GPU driver is, Triton compiles the kernels written for the CPU tensors instead of stopping.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton stops for want of a GPU driver only on a CPU")


@cpu_only
def test_strided_rows_launch_fixed_unless_a_load_is_per_row(monkeypatch):
    """Inductor's own kernel features, read by the choices `compile_package` compiles under."""
    rows = type(lowering.persistent_rows())
    given, real = [], rows.triton_kernel_kwargs
    monkeypatch.setattr(rows, "triton_kernel_kwargs", lambda *args: given.append(real(*args)) or given[-1])
    for scale, launch in [(torch.ones(()), lowering.STRIDED_ROW_CONFIG), (torch.rand(256, 1), None)]:
        given.clear()
        assert "active drivers" in written_on_a_cpu(compile_package, row_norm(scale))  # the kernel was written
        assert [kwargs["fixed_config"].config if "fixed_config" in kwargs else None for kwargs in given] == [launch]


@cpu_only
def test_inductor_cannot_write_a_per_row_load_at_a_fixed_launch_of_one_row():
    """Why `persistent_rows` leaves such kernels Inductor's launch (torch 2.11): forced to the fixed
    launch, the same kernel fails in Inductor's code generation."""
    from torch._inductor.codegen.triton import FixedTritonConfig

    class Fixed(type(lowering.persistent_rows())):  # the same rows in registers, every launch fixed
        def triton_kernel_kwargs(self, kernel_cls, features, groups, kernel_kwargs):
            return {**kernel_kwargs, "fixed_config": FixedTritonConfig(dict(lowering.STRIDED_ROW_CONFIG))}

    program = row_norm(torch.rand(256, 1))
    with V.set_choices_handler(Fixed()), tempfile.TemporaryDirectory() as tmp:
        error = written_on_a_cpu(torch._inductor.aoti_compile_and_package, program, package_path=f"{tmp}/p.pt2")
    assert "TypeError: list indices must be integers or slices, not NoneType" in error


class RowQuantize(torch.nn.Module):
    """torchao's row-wise FP8 quantization of an activation (a row's abs-max / 448, divide, clamp to
    +-448, cast), what every FP8 GEMM's input kernel computes."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

        scale = _choose_scale_float8(x, [1] * (x.dim() - 1) + [x.shape[-1]], torch.float8_e4m3fn)
        return _quantize_affine_float8(x, scale, torch.float8_e4m3fn), scale


def kernel_bodies(monkeypatch, compile_: Any, *args: Any) -> list[str]:
    """The loads, bodies, computations and stores of the Triton kernels Inductor writes for CPU tensors
    under `compile_(*args)` (`written_on_a_cpu`), read off Inductor's own kernels as it finishes each (a
    spy on `TritonKernel.codegen_kernel`, which writes the body before it stops for want of a driver;
    the stores are read there, while the graph they name is being lowered)."""
    from torch._inductor.codegen.triton import TritonKernel

    kernels, real = [], TritonKernel.codegen_kernel

    def spy(self: TritonKernel, *a: Any) -> Any:
        try:
            return real(self, *a)
        finally:
            kernels.append(str(self.loads) + str(self.body) + str(self.compute) + str(self.stores))

    monkeypatch.setattr(TritonKernel, "codegen_kernel", spy)
    assert "active drivers" in written_on_a_cpu(compile_, *args)
    return kernels


@cpu_only
def test_a_packages_clamps_are_tritons_native_nan_propagating_min_and_max(monkeypatch):
    program = torch.export.export(RowQuantize(), (torch.randn(64, 256, dtype=torch.bfloat16),))
    (body,) = kernel_bodies(monkeypatch, compile_package, program)
    assert body.count("tl.PropagateNan.ALL") == 2 and "tl.maximum(" in body and "tl.minimum(" in body, body
    assert "triton_helpers.maximum" not in body and "triton_helpers.minimum" not in body
    with tempfile.TemporaryDirectory() as tmp:  # Inductor's own, outside `compile_package`
        (own,) = kernel_bodies(monkeypatch, torch._inductor.aoti_compile_and_package, program, f"{tmp}/p.pt2")
    assert "triton_helpers.maximum" in own and "tl.PropagateNan" not in own


def test_native_min_max_is_this_threads_alone_and_left_as_entered_even_by_an_error():
    from torch._inductor.codegen.triton import TritonOverrides

    own = TritonOverrides.maximum("a", "b"), TritonOverrides.minimum("a", "b")
    assert own == ("triton_helpers.maximum(a, b)", "triton_helpers.minimum(a, b)")
    beside: list[str] = []
    with pytest.raises(RuntimeError, match="a compile failed"), lowering.native_min_max():
        with lowering.native_min_max():  # nested, as a compile inside another's C++ build
            assert TritonOverrides.maximum("a", "b") == "tl.maximum(a, b, tl.PropagateNan.ALL)"
        assert TritonOverrides.minimum("a", "b") == "tl.minimum(a, b, tl.PropagateNan.ALL)"
        thread = threading.Thread(target=lambda: beside.append(TritonOverrides.maximum("a", "b")))
        thread.start()
        thread.join()
        raise RuntimeError("a compile failed")
    assert (TritonOverrides.maximum("a", "b"), TritonOverrides.minimum("a", "b")) == own
    assert beside == [own[0]]  # a compile on another thread meanwhile: Inductor's own


class HeadRowMax(torch.nn.Module):
    """The abs-max over each 128-wide head row of two streams joined along the tokens, as
    `fa3.quantize_per_head` computes it for FLUX's joint V (text and image)."""

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        return torch.cat([text, image], 1).unflatten(-1, (-1, 128)).abs().amax(-1)


@cpu_only
def test_a_row_joined_by_a_cat_stays_in_one_program(monkeypatch):
    """A GPU lowering writes such a cat as a pointwise `where` inside the reduction, and Inductor then
    hints DEFAULT and loops over the 128-wide rows; a CPU lowering copies the cat out first unless
    told otherwise (`force_pointwise_cat`), so the test tells it."""
    tokens = torch.export.Dim("tokens", min=16, max=4096)
    inputs = (torch.randn(1, 16, 256, dtype=torch.bfloat16), torch.randn(1, 64, 256, dtype=torch.bfloat16))
    program = torch.export.export(HeadRowMax(), inputs, dynamic_shapes=(None, {1: tokens}))
    with torch._inductor.config.patch(force_pointwise_cat=True):
        (ours,) = kernel_bodies(monkeypatch, compile_package, program)
        with tempfile.TemporaryDirectory() as tmp:
            (own,) = kernel_bodies(monkeypatch, torch._inductor.aoti_compile_and_package, program, f"{tmp}/p.pt2")
    accumulator = re.compile(r"_tmp\d+ = tl.full")  # what a looped reduction carries from step to step
    assert "tl.where(" in ours and not accumulator.search(ours), ours  # the cat inside, the row read once
    assert accumulator.search(own), own  # Inductor's own choice loops


class RotatedHeads(torch.nn.Module):
    """FLUX's queries as diffusers makes them: each 128-wide head row RMS-normalized (`RMSNorm`, where
    `normalized`), then rotated pairwise by RoPE (`apply_rotary_emb`); x (batch, seq, heads, 128), cos
    and sin (seq, 128)."""

    def __init__(self, normalized: bool = True):
        from diffusers.models.normalization import RMSNorm

        super().__init__()
        self.norm = RMSNorm(128, eps=1e-6) if normalized else torch.nn.Identity()
        if normalized:
            torch.nn.init.uniform_(self.norm.weight, 0.5, 1.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from diffusers.models.embeddings import apply_rotary_emb

        return apply_rotary_emb(self.norm(x), (cos, sin), sequence_dim=1)


def rotated_heads_inputs(seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(1, seq, 2, 128, dtype=torch.bfloat16), torch.randn(seq, 128), torch.randn(seq, 128)


def rotated_heads(normalized: bool = True) -> torch.export.ExportedProgram:
    """`RotatedHeads` in bf16, exported with its tokens dynamic, as a package's are."""
    seq = torch.export.Dim("seq", min=16, max=4096)
    module = RotatedHeads(normalized).to(torch.bfloat16)
    return torch.export.export(module, rotated_heads_inputs(32), dynamic_shapes=({1: seq}, {0: seq}, {0: seq}))


def test_pair_rotations_become_flips_with_the_same_values_to_the_bit():
    exported = rotated_heads()
    before = str(exported.graph)
    program = decomposed(exported)
    targets = {node.target for node in program.graph.nodes}
    assert aten.flip.default in targets and aten.stack.default not in targets
    assert str(exported.graph) == before  # the program given is left as it was
    inputs = rotated_heads_inputs(40)  # another token count in the range
    assert torch.equal(program.module()(*inputs), exported.module()(*inputs))


class ComplexRotatedHeads(torch.nn.Module):
    """Qwen-Image's and Z-Image's RoPE: each head's pairs as complex numbers times `freqs` (seq, 64),
    complex, as `apply_rotary_emb_qwen` computes them, inside an autocast region as Z-Image's blocks do
    (torch.export keeps it a nested graph until the decomposition inlines it)."""

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        with torch.amp.autocast("cuda", enabled=False):
            return apply_rotary_emb_qwen(x, freqs, use_real=False)


def complex_rotated_inputs(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, seq, 2, 128, dtype=torch.bfloat16), torch.polar(torch.ones(seq, 64), torch.randn(seq, 64))


def test_complex_pair_rotations_become_real_flips_without_complex_ops():
    seq = torch.export.Dim("seq", min=16, max=4096)
    exported = torch.export.export(
        ComplexRotatedHeads(), complex_rotated_inputs(32), dynamic_shapes=({1: seq}, {0: seq})
    )
    program = decomposed(exported)
    targets = {node.target for node in program.graph.nodes}
    assert aten.flip.default in targets and aten.view_as_complex.default not in targets
    inputs = complex_rotated_inputs(40)  # within a bf16 rounding: the float32 products may round otherwise
    torch.testing.assert_close(program.module()(*inputs), ComplexRotatedHeads()(*inputs), rtol=2**-8, atol=1e-5)


def test_stacks_that_are_not_a_pair_rotation_are_left_as_they_are():
    class Other(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
            pairs = x.unflatten(-1, (2, -1))
            return torch.cat(
                [
                    torch.stack([real, -imag], -1).flatten(-2),  # the other sign
                    torch.stack([-imag, real], -2).flatten(-2),  # stacked along another dim
                    torch.stack(list(pairs.unbind(-2)), -1).flatten(-2),  # halves, not neighbours
                ],
                -1,
            )

    class ComplexPairs(torch.nn.Module):  # the rotation's form, over complex entries: no real [-1, 1] for them
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
            return torch.stack([-imag, real], -1).flatten(-2)

    for module, x in ((Other(), torch.randn(4, 8)), (ComplexPairs(), torch.randn(4, 8, dtype=torch.complex64))):
        exported = torch.export.export(module, (x,))
        assert not any(rotations.is_pair_rotation(node) for node in exported.graph.nodes)
        graph_module = torch.fx.GraphModule(exported.graph_module, copy.deepcopy(exported.graph))
        assert rotations.flip_pair_rotations(graph_module) == 0


@cpu_only
def test_a_rotated_pair_is_one_load_of_its_other_entry(monkeypatch):
    """Inductor writes `torch.stack` as loads masked by each entry's parity and a select between them;
    the flip, as one unmasked load. Without the norm, which a CPU lowering writes as a kernel of its own
    (the test's compile stops after the first kernel, `written_on_a_cpu`), and with the stack written
    pointwise, as a GPU lowering writes it (`force_pointwise_cat`; a CPU lowering copies it out)."""
    program = rotated_heads(normalized=False)
    with torch._inductor.config.patch(force_pointwise_cat=True):  # as a GPU lowering writes a stack
        (ours,) = kernel_bodies(monkeypatch, compile_package, program)
        with tempfile.TemporaryDirectory() as tmp:
            (own,) = kernel_bodies(monkeypatch, torch._inductor.aoti_compile_and_package, program, f"{tmp}/p.pt2")
    by_parity = re.compile(r"tl\.load\(.*, tmp\d+")  # a load masked by a computed condition
    assert by_parity.search(own), own
    assert not by_parity.search(ours) and ours.count("tl.load(") < own.count("tl.load("), ours


class SharedRows(torch.nn.Module):
    """Two FP8 linear layers reading the same normalized rows, each quantizing them as torchao's row-wise
    FP8 does (`RowQuantize`), as FLUX's single block's to_q, to_k, to_v and proj_mlp do."""

    def __init__(self, widths: tuple[int, ...] = (256, 512)):
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(n, 256).to(torch.float8_e4m3fn), requires_grad=False) for n in widths
        )
        self.scales = torch.nn.ParameterList(torch.nn.Parameter(torch.rand(1, n), requires_grad=False) for n in widths)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = F.rms_norm(x, (x.shape[-1],))
        products = []
        for weight, scale in zip(self.weights, self.scales, strict=True):
            quantized, row_scale = RowQuantize()(rows)
            products.append(
                torch._scaled_mm(
                    quantized.reshape(-1, rows.shape[-1]),
                    weight.t(),
                    row_scale.reshape(-1, 1).float(),
                    scale,
                    out_dtype=torch.bfloat16,
                )
            )
        return tuple(products)


@cpu_only
def test_rows_quantized_for_several_gemms_are_stored_once(monkeypatch):
    """The graph quantizes the rows once per layer; the package's kernel stores the FP8 rows and their
    scales once, where Inductor alone stores a copy of each for each `_scaled_mm` that reads them, from
    one quantization as from two (`shared_inputs`).
    Exported only: a CPU's `_scaled_mm` runs per-tensor scales alone, and the compile stops at the first
    kernel (`written_on_a_cpu`), this one."""
    program = torch.export.export(SharedRows(), (torch.randn(1, 64, 256, dtype=torch.bfloat16),))
    gemms = [node for node in decomposed(program).graph.nodes if node.target is aten._scaled_mm.default]
    assert len(gemms) == 2 and gemms[0].args[0] is gemms[1].args[0] and gemms[0].args[2] is gemms[1].args[2]
    (ours,) = kernel_bodies(monkeypatch, compile_package, program)
    own_compile = torch._inductor.aoti_compile_and_package
    with tempfile.TemporaryDirectory() as tmp:  # Inductor's own, on the merged graph and on the program
        (merged,) = kernel_bodies(monkeypatch, own_compile, decomposed(program), f"{tmp}/p.pt2")
        (own,) = kernel_bodies(monkeypatch, own_compile, program, f"{tmp}/q.pt2")
    assert ours.count("tl.store(") == 2, ours  # the FP8 rows, their scales
    assert merged.count("tl.store(") == own.count("tl.store(") == 4, merged


def test_shared_exact_inputs_is_this_threads_alone_and_left_as_entered_even_by_an_error():
    from aot.shared_inputs import _SHARED, shared_exact_inputs

    beside: list[bool] = []
    with pytest.raises(RuntimeError, match="a compile failed"), shared_exact_inputs():
        with shared_exact_inputs():  # nested, as a compile inside another's C++ build
            assert _SHARED.on
        assert _SHARED.on
        thread = threading.Thread(target=lambda: beside.append(getattr(_SHARED, "on", False)))
        thread.start()
        thread.join()
        raise RuntimeError("a compile failed")
    assert not _SHARED.on and beside == [False]  # a compile on another thread meanwhile: Inductor's own

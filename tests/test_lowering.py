"""aot/lowering.py on the CPU: the heuristic and the decomposition every package compiles with."""

import sympy
import torch
import torch.nn.functional as F
from conftest import TOLERANCE
from torch._inductor.choices import InductorChoices
from torch._inductor.graph import GraphLowering
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

from aot import lowering
from aot.blocks import rel_error
from aot.lowering import compile_package, decomposed, gelu_tanh_approx
from aot.runner import bind

aten = torch.ops.aten


class Row:
    """Stands in for the kernel features Inductor passes its choices (what the heuristics read): a
    CPU machine writes no Triton reduction, so Inductor never asks this question here."""

    def __init__(
        self, width: int | sympy.Symbol, hint: ReductionHint = ReductionHint.INNER, reductions: tuple = ()
    ):
        self.reduction_numel, self.hint = sympy.sympify(width), hint
        self.numel = 4608 * self.reduction_numel  # FLUX.1-dev's 4608 image tokens at 1024x1024
        self.reductions = reductions  # each reduction node's own hint

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
    assert lowering.tanh_approx(x.view(2, -1)).shape == (2, x.numel() // 2)
    assert torch.equal(lowering.tanh_approx(x), torch.tanh(x))
    for sample in (x.bfloat16(), torch.arange(-3, 4)):
        torch.library.opcheck(lowering.tanh_approx, (sample,))
    assert lowering.tanh_approx(torch.arange(-3, 4)).dtype == torch.get_default_dtype()


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


def test_strided_rows_stay_in_one_program_and_launch_with_the_fixed_configuration():
    from torch._inductor.codegen.triton import TritonKernel

    ours = lowering.persistent_rows()
    with V.set_graph_handler(GraphLowering(torch.fx.symbolic_trace(torch.nn.Identity()))):
        assert ours.should_use_persistent_reduction(strided(128), False)
        assert not InductorChoices().should_use_persistent_reduction(strided(128), False)  # so the heuristic changed
        fixed = ours.triton_kernel_kwargs(TritonKernel, strided(128), [], {"features": "kept"})
        assert fixed["features"] == "kept" and fixed["fixed_config"].config == lowering.STRIDED_ROW_CONFIG
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

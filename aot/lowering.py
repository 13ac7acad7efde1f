"""What every package asks of Inductor, and the call that compiles one: `compile_package`.

Five changes from Inductor's defaults, each measured on FLUX.1-dev's compiled step (BENCHMARKS.md):
the settings in `INDUCTOR_CONFIGS` (and `FP8_INDUCTOR_CONFIGS` over them, per FP8 granularity), one
heuristic in `persistent_rows`, tanh-approximated GELU computed with the GPU's own tanh
instruction (gelu.py's `gelu_tanh_approx`, `tanh_approx`) and RoPE's pair rotation as a flip
(`rotations.flip_pair_rotations`), both before Inductor lowers the graph, and min/max written as Triton's native
NaN-propagating instructions (`native_min_max`). A sixth, one stored FP8 input for the GEMMs that read the same
rows (`shared_inputs`), took 0.7 ms off the other kernels and left the step level (H100). Where the plan or
`norm_rope=on` asks, each head's RMS norm and RoPE are one call of a Triton kernel of ours instead
(`norm_rope_sites.fuse_norm_rope`): FLUX.1-dev's step 80.6 against 81.8 ms (H100).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import uuid
from typing import Any, Iterator

import torch

from aot.gelu import TANH_APPROX_PTX, gelu_tanh_approx
from aot.norm_rope_sites import fuse_norm_rope
from aot.rotations import flip_pair_rotations, is_pair_rotation
from aot.row_fp8_sites import fuse_row_fp8
from aot.shared_inputs import has_common_subexpressions, merge_common_subexpressions, shared_exact_inputs
from aot.thread_flags import ThreadFlag

# Inductor settings for every package. Weights stay out of the package: each block binds its own.
# No C++ build flag: the precompiled header is built ahead outside these (`portability.precompile_headers`).
INDUCTOR_CONFIGS: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
    # Store a pointwise result that is read more than once when it takes more than 16 ops,
    # instead of recomputing it in every kernel that reads it (Inductor's GPU default: 30). In
    # FLUX's single block the FP8 input of proj_out, cat(attention, gelu_tanh(mlp)), is read by the
    # row-amax and by the cast: one kernel instead of three (BENCHMARKS.md; measured while that
    # 15360-wide row was reduced in a loop, before `PERSISTENT_ROW_MAX` took it in).
    "realize_opcount_threshold": 16,
}
# Settings over `INDUCTOR_CONFIGS` for the packages of one FP8 granularity. `row-after` multiplies each
# GEMM's product by its row and column scales in the kernels that read it (fp8.RowScalesAfterGEMM):
# in FLUX's single block that puts the GELU's input past 16 ops, and Inductor then computes proj_out's
# FP8 input in three kernels (GELU, a looped abs-max, the cast) instead of one. At 32 it is one again:
# the single block took 1.599 ms against 1.794 ms at 16, where `row`'s took longer at 32 (1.605 against
# 1.490 ms) (H100, 4,096 + 512 tokens, BENCHMARKS.md "Row-wise FP8 where cuBLAS has none").
# `always_keep_tensor_constants`: each GEMM's 0-d unit scale stays the layer's `unit` buffer, which
# blocks bind (fp8.RowScalesAfterGEMM says what Inductor does without it).
FP8_INDUCTOR_CONFIGS: dict[str, dict[str, Any]] = {
    "row-after": {"realize_opcount_threshold": 32, "always_keep_tensor_constants": True}
}
# The widest row a reduction keeps in registers (`persistent_rows`): FLUX's 3072 features and its
# single block's 15360-wide `proj_out` input.
PERSISTENT_ROW_MAX = 16384
# The launch configuration of a persistent reduction over rows no wider than `STRIDED_ROW_MAX` whose
# other loads are strided (the q and k kernels: RMS norms over each head row, RoPE's interleaved pairs,
# FP8 casts): one row per program, one warp, coordinate descent's choice for FLUX.1-dev's single block's
# q and k kernel. That kernel took 2.62 ms a step against 3.50 ms looped (H200, 2026-12-07); Inductor's
# own candidates for such rows took 4.02 ms against 3.47 looped (H100) (BENCHMARKS.md, section (e)). Since
# `flip_pair_rotations` FLUX's pairs are one unmasked load each: Inductor hints those rows INNER and picks its own
# launch (2.59 ms a step, 8 rows and 2 warps, H100). Rows strided otherwise still launch with this, such as
# Qwen-Image's q and k after the flip, whose RoPE factors are read at every other float.
STRIDED_ROW_CONFIG = {"XBLOCK": 1, "num_warps": 1, "num_stages": 1}
STRIDED_ROW_MAX = 256
# The decompositions `compile_package` runs on every exported program before Inductor sees it.
DECOMPOSITIONS = {torch.ops.aten.gelu.default: gelu_tanh_approx}


@functools.cache
def _lower_tanh_approx() -> None:
    """Teach Inductor `tanh_approx`: on CUDA (not ROCm) `TANH_APPROX_PTX` on the value as float32, a
    pointwise op it fuses like any other; float64, integers and any other device, Inductor's own tanh.
    Once a process."""
    from torch._inductor import lowering
    from torch._inductor.virtualized import ops

    ptx = lowering.make_pointwise(
        functools.partial(
            ops.inline_asm_elementwise, asm=TANH_APPROX_PTX, constraints="=r,r", dtype=torch.float32, pack=1
        )
    )

    @lowering.register_lowering(torch.ops.aot_lowering.tanh_approx.default, type_promotion_kind=None)
    def _(x: Any) -> Any:
        dtype = x.get_dtype()
        on_ptx = x.get_device().type == "cuda" and not torch.version.hip
        if not on_ptx or dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return lowering.lowerings[torch.ops.aten.tanh.default](x)
        return lowering.to_dtype(ptx(lowering.to_dtype(x, torch.float32)), dtype)


@functools.cache
def persistent_rows() -> Any:
    """Inductor's choices for every package, with one heuristic changed: a reduction along a row
    (`ReductionHint.INNER`) of a static width up to `PERSISTENT_ROW_MAX` is persistent, the whole row
    in one program's registers, read once; Inductor's own limit is 1024. The layer norms over 3072
    features and the row abs-max before every FP8 GEMM of FLUX's blocks then read their rows once
    instead of in a loop. Every other reduction, a width known only at run time, and everything while
    `triton.persistent_reductions` is off get Inductor's own answer (`InductorChoices`). A row whose
    reductions read it contiguously counts even where other loads stride (`strided_rows`), and up to
    `STRIDED_ROW_MAX` wide such a kernel launches with `STRIDED_ROW_CONFIG`, fixed at compile time
    (`triton_kernel_kwargs`, Inductor's hook for fixed configurations): Inductor's own candidates
    for them are slower than its looped reduction. A kernel that loads a value per row (a row's scale,
    `row_indexed_loads`) keeps Inductor's launch: Inductor cannot write it at the fixed one. A row
    that every read of the kernel walks with stride 1 counts too, whatever its hint (`contiguous_rows`):
    Inductor hints DEFAULT where the row comes through a `cat` it fuses into the reduction, such as
    the abs-max over each head's row of FLUX's joint V (`fa3.quantize_per_head`), and loops over it.

    Measured on an H100 (BENCHMARKS.md, "Persistent row reductions"): up to 4096, FLUX.1-dev's step
    took 93.7-94.0 against 95.0-95.4 ms and FLUX.2 klein's 39.8 against 40.9 ms. Up to 16384, the
    single block's GELU + abs-max + cast kernel took 122 against 140 us with its GELU as a sigmoid
    (before `gelu_tanh_approx`); with tanhf, the wider limit made it slower. Rows read contiguously
    through a `cat`: the double block's V abs-max took 0.24 against 0.66 ms a step looped (2026-12-07).
    """
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint

    def strided_rows(features: Any) -> bool:
        """Every reduction of the kernel reads contiguous rows; its own hint is DEFAULT where some
        pointwise loads are strided (RoPE's interleaved pairs), and Inductor keeps such rows whole
        only up to 64 wide."""
        reductions = features.reduction_nodes()
        return bool(reductions) and all(features.reduction_hint(n) == ReductionHint.INNER for n in reductions)

    def read_indices(features: Any) -> tuple[Any, Any, list[Any]]:
        """The kernel's row and column symbols and the index of each of its reads, as Inductor's
        memory estimate of the kernel, persistent, simulates them."""
        from torch._inductor.codegen.simd_kernel_features import MemoryEstimator

        estimate = MemoryEstimator(features, (features.numel, features.reduction_numel))
        row, column = estimate.symbols
        return row, column, [dep.index for deps in estimate.persistent.reads.values() for dep in deps]

    def contiguous_rows(features: Any) -> bool:
        """Every read of the kernel that moves along the row moves by one element a step: a row of
        contiguous elements, whatever hint Inductor derived (it derives none through a `cat`'s
        piecewise index)."""
        import sympy

        _, column, indices = read_indices(features)
        steps = [sympy.simplify(i.subs(column, column + 1) - i) for i in indices if column in i.free_symbols]
        return bool(steps) and all(step == 1 for step in steps)

    def row_indexed_loads(features: Any) -> bool:
        """Some load of the kernel is indexed by the row alone, one value per row, such as a row's
        scale. At a fixed launch of one row a program Inductor drops the row dimension from the
        kernel's tensors (`no_x_dim`) and then cannot write such a load: torch 2.11's
        `TritonSymbols.get_block_shape` raises a TypeError (tests/test_lowering.py writes one on a CPU)."""
        row, column, indices = read_indices(features)
        return any(row in i.free_symbols and column not in i.free_symbols for i in indices)

    def rows_in_registers(features: Any, cooperative_reduction: bool) -> bool:
        width = features.reduction_numel
        return (
            config.triton.persistent_reductions  # Inductor's own off switch still turns them off
            and not cooperative_reduction
            and width.is_number
            and int(width) <= PERSISTENT_ROW_MAX
            and (
                features.get_reduction_hint() == ReductionHint.INNER
                or strided_rows(features)
                or contiguous_rows(features)  # last: it simulates the kernel's loads
            )
        )

    class PersistentRows(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features: Any, cooperative_reduction: bool) -> bool:
            if rows_in_registers(features, cooperative_reduction):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

        def triton_kernel_kwargs(self, kernel_cls: Any, features: Any, groups: Any, kernel_kwargs: dict) -> dict:
            from torch._inductor.codegen.triton import FixedTritonConfig

            if (
                features.get_reduction_hint() != ReductionHint.INNER
                and strided_rows(features)
                and rows_in_registers(features, config.triton.cooperative_reductions)
                and int(features.reduction_numel) <= STRIDED_ROW_MAX
                and not row_indexed_loads(features)
            ):
                return {**kernel_kwargs, "fixed_config": FixedTritonConfig(dict(STRIDED_ROW_CONFIG))}
            return kernel_kwargs

    return PersistentRows()


def decomposed(
    exported: torch.export.ExportedProgram, ours: frozenset[str] = frozenset()
) -> torch.export.ExportedProgram:
    """`exported` with `DECOMPOSITIONS` run on it, the kernels of ours in `ours` written in (with "norm_rope"
    each head's norm and RoPE as one call of norm_rope.py's kernel, `fuse_norm_rope`; with "row_fp8" the FP8
    rows of a `cat` or a GELU as one call of row_fp8.py's, `fuse_row_fp8`), the pair rotations left flipped
    (`flip_pair_rotations`) and its common subexpressions merged (`merge_common_subexpressions`); `exported`
    itself where it has no tanh GELU, no pair rotation, nothing to merge and "row_fp8" is not asked (a
    re-trace costs 0.35-0.72 s per FLUX block class: BENCHMARKS.md). `exported` is left as it was."""
    graphs = [m.graph for m in exported.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    rewrites = any(_is_tanh_gelu(node) or is_pair_rotation(node) for graph in graphs for node in graph.nodes)
    if not rewrites and "row_fp8" not in ours and not has_common_subexpressions(exported.graph):
        return exported  # (nested graphs: an autocast region's, which the decomposition inlines)
    program = exported.run_decompositions(DECOMPOSITIONS)  # a new program: its graph is ours to edit
    if "norm_rope" in ours:
        fuse_norm_rope(program.graph_module)
    if "row_fp8" in ours:
        fuse_row_fp8(program.graph_module)
    flip_pair_rotations(program.graph_module)
    merge_common_subexpressions(program.graph_module)
    return program


def _is_tanh_gelu(node: torch.fx.Node) -> bool:
    if node.target is not torch.ops.aten.gelu.default:
        return False
    return node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none") == "tanh"


@contextlib.contextmanager
def native_min_max() -> Iterator[None]:
    """While inside, on this thread, Inductor writes a Triton kernel's elementwise min and max (clamps,
    ReLUs, a looped max reduction's step) as Triton's native `tl.minimum`/`tl.maximum` with
    `tl.PropagateNan.ALL`, one instruction on sm_80 and later (Triton emulates it before), where on CUDA
    it writes `triton_helpers.minimum`/`maximum`: two compares, an or and a select. Both propagate NaN
    from either operand. They differ only between zeros of opposite sign: the native max of -0 and +0 is
    +0, so a ReLU of -0.0 gives +0.0 where Inductor's own gives -0.0. Inductor writes the native
    form on ROCm already, and pytorch/pytorch#190404 proposes it for CUDA. A persistent reduction's final
    max keeps `triton_helpers.max2`, whose step the kernel's module cannot name natively.

    It matters because the kernels that quantize a GEMM's input to FP8 compute more than they read: the
    clamp to +-448 is two min/max an element. FLUX.1-dev's single block's `proj_out` input (GELU + cat +
    row abs-max + FP8 cast, 4608 x 15360) ran at 71% of the H100's compute and 48% of its memory
    throughput (Nsight Compute); written natively it took 81.9 against 103.6 us a call, with the same
    FP8 values and scales, NaN rows included (H100, 2026-12-07). In the step: other kernels 17.1
    against 18.6 ms, the step 81.3 against 82.3 ms, sm120's 91.6 against 92.6 ms (BENCHMARKS.md).

    `TritonOverrides` gets, once a process, methods that write the native form on a thread inside and
    Inductor's own elsewhere: a compile on another thread (`overlap.overlapped`'s next class enters its
    own) or a user's `torch.compile` beside it is Inductor's. Nests; an error leaves it as entered.
    """
    _teach_native_min_max()
    with _NATIVE.entered():
        yield


_NATIVE = ThreadFlag()  # on: this thread is inside `native_min_max`


@functools.cache
def _teach_native_min_max() -> None:
    """Give `TritonOverrides` a `minimum` and `maximum` that write the native form inside
    `native_min_max` and call Inductor's own otherwise. Once a process."""
    from torch._inductor.codegen.triton import TritonOverrides

    def written(name: str) -> Any:
        own = getattr(TritonOverrides, name)

        def write(a: Any, b: Any) -> str:
            return f"tl.{name}({a}, {b}, tl.PropagateNan.ALL)" if _NATIVE.on else own(a, b)

        return staticmethod(write)

    TritonOverrides.minimum, TritonOverrides.maximum = written("minimum"), written("maximum")


def compile_package(
    exported: torch.export.ExportedProgram, fp8: str | None = None, ours: frozenset[str] = frozenset()
) -> bytes:
    """AOTInductor-compile `exported` (after `decomposed`, `ours` passed on) into a weights-less `.pt2`
    package; returns its bytes. `fp8`: the FP8 granularity its linear layers were quantized at, or None; it
    picks the settings `FP8_INDUCTOR_CONFIGS` holds for it over `INDUCTOR_CONFIGS`.

    Its generated files get a name of their own (`aot_inductor.model_name_for_generated_files`), not
    their code's hash: Inductor holds a file lock named after it through the C++ build, and the next
    class compiles inside that build (`overlap.overlapped`). Two classes with the same code (Z-Image's
    refiners and layers can be) would wait on each other's lock for ever.
    """
    from torch._inductor.virtualized import V

    _lower_tanh_approx()
    exported = decomposed(exported, ours)
    settings = {**INDUCTOR_CONFIGS, **FP8_INDUCTOR_CONFIGS.get(fp8, {})}
    settings["aot_inductor.model_name_for_generated_files"] = f"block_{uuid.uuid4().hex}"
    with (
        tempfile.TemporaryDirectory() as tmp,
        V.set_choices_handler(persistent_rows()),
        native_min_max(),
        shared_exact_inputs(),
    ):
        path = os.path.join(tmp, "package.pt2")
        torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=settings)
        with open(path, "rb") as f:
            return f.read()

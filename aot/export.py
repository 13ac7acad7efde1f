"""capture -> export -> compile: one weights-less AOTInductor package per repeated block class.

`compile_blocks(pipe, target, trials)` walks this GPU's `Trials` (plans.py): each attention kernel
and FP8 granularity is a trial (export, compile, load, parity against eager) that falls back to the next
with its reason; only the plain bf16 SDPA block has no fallback.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from typing import Any, NamedTuple

import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

from aot import portability
from aot.attention import (
    LOW_PRECISION,
    TIMED,
    attention_backend,
    attention_op,
    ms_per_call,
    recorded_shapes,
    speed_note,
)
from aot.blocks import forward_signature, pre_hooks, rel_error, repeated_blocks
from aot.compiled import BlockPackage, Compiled
from aot.contract import CapturedCall, Contract, contract_from_captures
from aot.fa3 import FA3_KERNELS
from aot.families import Family, family
from aot.fingerprint import fingerprint
from aot.fp8 import FP8_MAX_REL_ERROR, FP8_MIN_FEATURES, fewest_rows, quantize_block_
from aot.lowering import compile_package
from aot.overlap import overlapped
from aot.plans import Trials, Walk, brief
from aot.runner import bind
from aot.target import Target

log = logging.getLogger("compile")


# Inputs are captured at this size (the shape hint Inductor tunes for; every family's default size)
# and once more at the smallest size, to find which input dimensions follow the image-token count.
CAPTURE_SIZE = (1024, 1024)
# The capture calls' prompt, and a second one where the text length follows the prompt
# (`Family.captures`): longer by far more than any padding step, far shorter than max_sequence_length.
CAPTURE_PROMPT = "capture"
LONG_PROMPT = "a photo of a red fox in fresh snow, morning light, " * 4
# The key under which `compile_blocks` captures the transformer's own call (beside its blocks').
TRANSFORMER = "<transformer>"
# Compiled block vs eager block on the captured inputs, ||out - ref|| / ||ref||. bf16 and fp32
# packages land far below; a larger error means the package computes something else.
MAX_REL_ERROR = 1e-2
# A low-precision attention trial's first step (`fa3-fp8`, `sage`), before any compile: each class's first
# block, eager, with that attention (its linear layers in bf16) against its eager output on the captured
# inputs. It may move a block as far as a bf16 package may; FP8 GEMMs get their own bound after
# (BENCHMARKS.md, "FA3's FP8 forward").
FP8_ATTENTION_MAX_REL_ERROR = MAX_REL_ERROR


class Captured(NamedTuple):
    """One block class as `compile_blocks` found it in the pipeline's calls: what each trial runs."""

    block: torch.nn.Module  # the class's first block
    inputs: list[dict[str, Any]]  # its captured calls' keyword arguments; exported on the first
    contract: Contract
    references: list[Any]  # the eager block's outputs on `inputs`
    rows: dict[str, int]  # each linear layer's fewest input rows in those calls (`fp8.fewest_rows`)


@contextlib.contextmanager
def capture(modules: dict[str, torch.nn.Module]):
    """Record the first call's inputs of each module while the block runs as usual.

    Yields a dict filled in as the modules are called: name -> (args, kwargs), args bound to
    keyword names by the module's forward signature.
    """
    calls: dict[str, CapturedCall] = {}

    def record(name: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if name not in calls:
            calls[name] = ((), dict(forward_signature(module).bind(*args, **kwargs).arguments))

    with pre_hooks(modules, record):
        yield calls


def capture_blocks(
    pipe: Any,
    modules: dict[str, torch.nn.Module],
    sizes: list[tuple[int, int]],
    prompt: str = CAPTURE_PROMPT,
    row: Family | None = None,
) -> list[dict[str, CapturedCall]]:
    """Capture the first call's inputs of every module (block groups' first blocks, the transformer)
    from one real pipeline call per size.

    Each call is the one the app makes (`families.Family.call`: keyword arguments, the family's
    text length, guidance where the model takes it, an input image of the output size for an edit
    family), with the family's `min_steps`, stopped at latents. `row`: the pipeline's family
    row (`Target.family`), looked up when not given.

    Raises:
        RuntimeError: a module was not called by the pipeline.
    """
    row = row or family(type(pipe).__name__)
    captured = []
    for height, width in sizes:
        with capture(modules) as calls:
            pipe(**row.capture_call(pipe, prompt, height, width), output_type="latent")
        missing = sorted(set(modules) - set(calls))
        if missing:
            raise RuntimeError(f"the pipeline call at {height}x{width} never called {', '.join(missing)}")
        captured.append(calls)
    return captured


def dynamic_shapes(contract: Contract, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The `dynamic_shapes` spec for `torch.export.export`, covering every captured kwarg.

    One `Dim` per form of `contract.TensorSpec`: `image_tokens` (I) and `text_tokens` (L), ranged by
    the contract; a dim `a * I + c` is derived from I (likewise for L). A dim following both, `a * I
    + b * L + c` (Z-Image's joint sequence), gets its own `Dim` over `a * I + b * L`: export takes
    derived dims of one root only.
    """
    roots: dict[tuple[int, int], Dim] = {}

    def root(form: tuple[int, int]) -> Dim:
        if form not in roots:
            name = {(1, 0): "image_tokens", (0, 1): "text_tokens"}.get(form, f"tokens_{form[0]}i_{form[1]}t")
            lo, hi = contract.form_range(form)
            roots[form] = Dim(name, min=lo, max=hi)
        return roots[form]

    specs = iter(contract.tensors)

    def dims(leaf):
        if not isinstance(leaf, torch.Tensor):
            return None
        spec = next(specs)
        dynamic = {}
        for d, (size, off) in enumerate(zip(spec.shape, spec.offsets, strict=True)):
            if size is not None:
                continue
            a, b = spec.form(d)
            if a and b:
                dim = root((a, b))
            else:
                dim = root((1, 0) if a else (0, 1))
                dim = dim * (a or b) if (a or b) != 1 else dim
            dynamic[d] = dim + off if off else dim
        return dynamic or None

    return pytree.tree_map(dims, kwargs)


def export_block(block: torch.nn.Module, kwargs: dict[str, Any], contract: Contract) -> torch.export.ExportedProgram:
    """`torch.export` one block on its captured inputs, with the image-token dim dynamic."""
    with torch.no_grad():
        return torch.export.export(block, args=(), kwargs=kwargs, dynamic_shapes=dynamic_shapes(contract, kwargs))


def start_compile_workers(device: torch.device) -> None:
    """Start Inductor's Triton compile workers now (on CUDA; a CPU package has no Triton kernel).

    Inductor compiles a Triton kernel in its worker pool only once the pool answers; until then it
    compiles each one here, one after another (`AsyncCompile.use_process_pool`), and the pool is
    first asked for at the first kernel. `torch.compile` starts it when its backend is created
    (`maybe_warm_pool`); an AOTInductor compile does not, so `compile_blocks` starts it before its
    captures and exports, which take longer than the pool's start (BENCHMARKS.md).
    """
    if device.type == "cuda":
        from torch._inductor.async_compile import (  # heavy: at first use
            maybe_warm_pool,
        )

        maybe_warm_pool()


def compile_blocks(pipe: Any, target: Target, trials: Trials) -> Compiled:
    """Capture, export and compile one package per repeated block class of `pipe.transformer`.

    Leaves `pipe` as it was (FP8 is tried on a copy of one block). Runs on the GPU the pipeline is
    on: on ZeroGPU, inside the worker (compile.py's `compile_transformer` calls it in its
    `@spaces.GPU` function). `target` and `trials` are the pipeline's and this GPU's, worked out once
    by the caller (`Target.of`, `Trials.resolve`), which hands the same ones to the load path.

    Raises:
        ValueError: no repeated blocks, or inputs the shape rule cannot describe.
        RuntimeError: a compiled bf16 block of the last attention kernel (an explicitly requested
            one, or the plan's SDPA) does not match its eager block; or an explicitly requested
            `fa3-fp8` or `sage` moves a first block by more than `FP8_ATTENTION_MAX_REL_ERROR`.
        Exception: what the last attention kernel's export or compile raised, or, with `fp8=on`,
            what the last FP8 granularity's trial raised.
    """
    transformer = pipe.transformer
    blocks = repeated_blocks(transformer)
    resolution, kernels = target.resolution, trials.attention.steps
    log.info("%s", trials.planned)
    if resolution.min_side == resolution.max_side:
        raise ValueError(
            f"sides {resolution.min_side}..{resolution.max_side} px: give two sizes (min_side < max_side); "
            "the captures at both ends find which block inputs follow the image size"
        )
    failed = []
    # Vector ISA and target (portability.py); the compilers start working now, while the blocks are captured.
    with portability.compile_scope(transformer.device):
        start_compile_workers(transformer.device)
        classes = _capture_classes(pipe, blocks, target)
        for kernel in kernels:  # the plan's attention kernels, each a trial; the last one has no fallback
            try:
                note = _attention_note(classes, kernel, timed=trials.attention.asked == "auto")
                packages, granularity, walked = _compile_classes(classes, kernel, trials.fp8, trials.ours)
                break
            except Exception as exc:
                if kernel == kernels[-1]:
                    raise
                failed.append(f"{kernel} failed its trial ({brief(exc)})")
                log.warning("attention: %s", failed[-1])
    attention = trials.attention.decision(kernel, [*failed, note])
    fp8 = trials.fp8.decision(granularity or "off", walked)
    log.info("%s", attention)
    log.info("%s", fp8)
    fa3_kernel = trials.fa3_kernel if kernel in FA3_KERNELS else None
    valid_for = fingerprint(transformer, resolution, kernel, fp8.value, fa3_kernel, trials.ours)
    valid_for["cpu_isa"] = portability.isa_built_for(transformer.device)  # what they need: portability.isa_problem
    valid_for.update(portability.runtimes_needed(*(p.package for p in packages.values())))  # and runtime_problem
    decisions = [trials.planned, attention, fp8, trials.norm_rope, trials.row_fp8]
    return Compiled(packages, decisions, resolution, fa3_kernel, granularity, valid_for)


def _capture_classes(pipe: Any, blocks: dict[str, list[torch.nn.Module]], target: Target) -> dict[str, Captured]:
    """Capture each block class's first block in the pipeline calls its family asks for (both ends
    of the image sizes; where the text length follows the prompt, a short and a long prompt), and
    run it on them: class name -> `Captured`, what `_compile_classes` takes."""
    resolution, row, transformer = target.resolution, target.family, pipe.transformer
    capture_size = tuple(min(max(s, resolution.min_side), resolution.max_side) for s in CAPTURE_SIZE)
    sizes = [capture_size, (resolution.min_side, resolution.min_side)]
    if resolution.tokens(*sizes[0]) == resolution.tokens(*sizes[1]):
        sizes[1] = (resolution.max_side, resolution.max_side)
    firsts = {name: found[0] for name, found in blocks.items()}
    modules = {**firsts, TRANSFORMER: transformer}
    wanted = row.captures(sizes, CAPTURE_PROMPT, LONG_PROMPT)
    captures = [c for size, prompt in wanted for c in capture_blocks(pipe, modules, [size], prompt, row)]
    points = [
        (row.image_tokens(resolution, *size, row.capture_references), row.text_tokens_of(c[TRANSFORMER][1]))
        for (size, _), c in zip(wanted, captures, strict=True)
    ]
    image_range = row.image_range(resolution)
    classes = {}
    for name, block in firsts.items():
        calls = [c[name] for c in captures]
        inputs = [kwargs for _, kwargs in calls]  # exported on the first; every one is a trial input
        with torch.no_grad(), fewest_rows(block) as rows:
            references = [block(**kwargs) for kwargs in inputs]
        contract = contract_from_captures(name, calls, points, resolution, image_range, row.text_range)
        classes[name] = Captured(block, inputs, contract, references, rows)
    return classes


def _low_precision_errors(classes: dict[str, Captured], kernel: str) -> dict[str, float]:
    """Class name -> how far its first block, eager, moves with attention `kernel` (one of
    `LOW_PRECISION`; the linear layers stay bf16): the largest ||out - ref|| / ||ref|| over the
    captured inputs, `ref` the eager block's output there (`Captured.references`). The class's other
    blocks are not run: their inputs are not captured. Needs what `kernel` needs (`fa3-fp8`: FA3
    loaded, a Hopper GPU; `sage`: a GPU Triton compiles FP8 matmuls for)."""
    with attention_backend(kernel), torch.no_grad():
        return {
            name: max(rel_error(c.block(**kw), ref) for kw, ref in zip(c.inputs, c.references, strict=True))
            for name, c in classes.items()
        }


def _attention_note(classes: dict[str, Captured], kernel: str, timed: bool) -> str:
    """What the attention decision says of `kernel`: its name; where `timed` (chosen by the plan, not
    asked for) and its gain depends on the GPU (`TIMED`), its time against SDPA's at the blocks'
    shapes (`_timed_note`); for a low-precision kernel (`LOW_PRECISION`) the largest eager block
    error it makes (`_low_precision_errors`), checked first.

    Raises:
        RuntimeError: the kernel is not `attention.MIN_GAIN` times faster than SDPA here, or a
            class's error is above `FP8_ATTENTION_MAX_REL_ERROR`.
    """
    notes = []
    if kernel in LOW_PRECISION:  # first: what the kernel refuses (a mask) shows here, before any timing
        errors = _low_precision_errors(classes, kernel)
        worst = max(errors, key=errors.__getitem__)
        if not errors[worst] <= FP8_ATTENTION_MAX_REL_ERROR:
            raise RuntimeError(
                f"{worst}: {kernel} attention moves the eager block by {errors[worst]:.1e} (relative), "
                f"above {FP8_ATTENTION_MAX_REL_ERROR:.0e}"
            )
        notes.append(f"eager first blocks within {errors[worst]:.1e} of eager, <= {FP8_ATTENTION_MAX_REL_ERROR:.0e}")
    if timed and kernel in TIMED:
        notes.insert(0, _timed_note(classes, kernel))
    return f"{kernel} ({'; '.join(notes)})" if notes else kernel


def _timed_note(classes: dict[str, Captured], kernel: str) -> str:
    """`kernel`'s time against SDPA's for the attention calls each class's first block makes on its
    first captured input (`attention.ms_per_call`, `attention.speed_note`).

    Raises:
        RuntimeError: `kernel` is not `attention.MIN_GAIN` times faster than SDPA.
    """
    with recorded_shapes() as shapes, torch.no_grad():
        for captured in classes.values():
            captured.block(**captured.inputs[0])
    device = next(next(iter(classes.values())).block.parameters()).device
    return speed_note(kernel, ms_per_call(kernel, shapes, device), ms_per_call("sdpa", shapes, device))


def _compile_classes(
    classes: dict[str, Captured], attention: str, fp8: Walk, ours: frozenset[str] = frozenset()
) -> tuple[dict[str, BlockPackage], str | None, list[str]]:
    """One package per class with `attention`; FP8 at the first of `fp8.steps` (granularities) whose
    trial runs. `classes`: class name -> `Captured`; `ours`: the kernels of ours the packages compute with
    (`Trials.ours`, `lowering.compile_package`).

    The granularities are walked in order. One whose FP8 block fails to export, compile, load or
    run for a class is dropped for every class (the GPU cannot run it) and the next is tried. A
    class whose FP8 block runs but differs from eager by more than `FP8_MAX_REL_ERROR` stays in bf16
    (unless `fp8.required`). Returns the packages, the granularity they use (None: all bf16), and the walk: a
    note per step, ending in "bf16" where no granularity was kept. Each class compiles while the one
    before it builds its wrapper's C++ (`overlap.overlapped`); results and errors keep the classes' order.

    Raises:
        RuntimeError: a bf16 package differs from its eager block by more than `MAX_REL_ERROR`
            (`FP8_MAX_REL_ERROR` under a low-precision kernel: its attention makes it an FP8 block).
        Exception: what the bf16 export or compile raised (the caller falls back to the next
            attention kernel), or, where `fp8.required`, what the last granularity's trial raised.
    """

    bound = FP8_MAX_REL_ERROR if attention in LOW_PRECISION else MAX_REL_ERROR  # an FP8 block

    def bf16(name: str) -> BlockPackage:
        block, inputs, contract, references, _ = classes[name]
        package = _compile_class(name, block, inputs, contract, attention, references, None, ours)
        if not package.rel_error <= bound:
            raise RuntimeError(
                f"{name}: compiled package differs from eager by {package.rel_error:.2e} (relative), above {bound:.0e}"
            )
        return package

    def bf16_all(names: list[str]) -> dict[str, BlockPackage]:
        with overlapped([functools.partial(bf16, n) for n in names]) as jobs:
            return {name: job.result() for name, job in zip(names, jobs, strict=True)}

    def fp8_trial(name: str, granularity: str) -> tuple[tuple[int, int], BlockPackage | None]:
        block, inputs, contract, references, rows = classes[name]
        quantized = copy.deepcopy(block)
        counts = quantize_block_(quantized, granularity, rows)
        if counts[0] == 0:
            return counts, None
        return counts, _compile_class(name, quantized, inputs, contract, attention, references, granularity, ours)

    walk, granularities = [], fp8.steps
    for granularity in granularities:
        kept, notes = {}, []
        try:
            with overlapped([functools.partial(fp8_trial, name, granularity) for name in classes]) as jobs:
                for name, job in zip(classes, jobs, strict=True):
                    counts, package = job.result()
                    if package is None:
                        notes.append(f"{name}: all {counts[1]} linear layers narrower than {FP8_MIN_FEATURES}, bf16")
                        continue
                    note = f"{name} {counts[0]} layers FP8, {counts[1]} kept, rel. error {package.rel_error:.1e}"
                    if not package.rel_error <= FP8_MAX_REL_ERROR and not fp8.required:
                        note += f" > {FP8_MAX_REL_ERROR:.0e}: bf16"
                    else:
                        kept[name] = package
                    notes.append(note)
        except Exception as exc:
            if fp8.required and granularity == granularities[-1]:
                raise
            walk.append(f"{granularity} failed its trial ({name}: {brief(exc)})")
            log.warning("fp8: %s", walk[-1])
            continue
        walk.append(f"{granularity}: " + "; ".join(notes))
        if kept:
            packages = {**bf16_all([n for n in classes if n not in kept]), **kept}
            return {name: packages[name] for name in classes}, granularity, walk
    return bf16_all(list(classes)), None, walk + ["bf16"] * bool(granularities)


def _compile_class(
    name: str,
    block: torch.nn.Module,
    inputs: list[dict[str, Any]],
    contract: Contract,
    attention: str,
    references: list[Any],
    fp8: str | None,
    ours: frozenset[str] = frozenset(),
) -> BlockPackage:
    """Export and compile `block` (FP8-quantized at granularity `fp8`, or None; `ours`: the kernels of ours
    it computes with, `Trials.ours`) under `attention`
    ("fa3", "fa3-fp8", "sage" or "sdpa") on the first of `inputs` (a block's captured calls), then run the package on
    each of them against the eager block's output there (`references`): the trial covers every
    captured shape, both image sizes and, where the text length follows the prompt, the shortest
    and the longest text (cuBLAS can refuse an FP8 GEMM at one shape and not another: BENCHMARKS.md).
    rel_error is the largest of those."""
    start = time.perf_counter()
    with attention_backend(attention):
        exported = export_block(block, inputs[0], contract)
    export_s = time.perf_counter() - start
    op = attention_op(attention)
    if op is not None:
        if not any(node.target is op for node in exported.graph.nodes):
            raise RuntimeError(f"{name}: attention={attention}, but the exported graph calls no {op}")
    start = time.perf_counter()
    package = compile_package(exported, fp8, ours)
    compile_s = time.perf_counter() - start
    runner, constants = bind(package, block)
    with torch.no_grad():
        error = max(rel_error(runner(**kw), ref) for kw, ref in zip(inputs, references, strict=True))
    log.info(
        "%s: exported in %.1fs, compiled in %.1fs, %d bytes, rel. error %.1e",
        name,
        export_s,
        compile_s,
        len(package),
        error,
    )
    return BlockPackage(
        block=name,
        package=package,
        contract=contract,
        constants={n: (tuple(t.shape), t.dtype) for n, t in constants.items()},
        fp8=fp8,
        export_s=export_s,
        compile_s=compile_s,
        rel_error=error,
    )

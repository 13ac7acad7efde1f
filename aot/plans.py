"""The decision: which fast paths the blocks try on this GPU, in what order, and why, worked out once.

FlashAttention-3 and FP8 inside the compiled blocks (fa3.py, fp8.py), each head's norm and RoPE in a
kernel of ours (norm_rope.py), CUDA graphs around the step (graphs.py): each resolved to a `Decision`, in
the order the GPU's `Plan` gives (`PLANS`, keyed by compute capability). `Trials.resolve` holds the whole
decision; `export.compile_blocks` walks it, running each step as a trial that falls back to the next, and
`loading.load_packages` looks for the packages a compile would make; neither reads the options again.

`auto` takes a fast path only where it can run and says why not otherwise; an explicit request
that cannot run raises with what is missing. Off Hopper (an RTX Pro 6000 Blackwell on ZeroGPU, an
L40S, an A100) attention is SageAttention's recipe in Triton (sage.py) where there are FP8 tensor
cores, else torch's SDPA, which picks its fastest kernel for the GPU at hand.
Nothing here runs at import: capability probes and kernel loads happen inside `Trials.resolve`
and at a compiled block's first call, in the GPU worker on ZeroGPU (zerogpu.py says what runs where).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from aot.fa3 import FA3_KERNELS, FA3_MAX_HEAD_DIM, load_fa3, unit_scale_problem
from aot.model_config import attention_head_dim
from aot.options import Options
from aot.sage import head_dim_problem
from aot.zerogpu_limits import ON_ZEROGPU


@dataclass(frozen=True)
class Plan:
    """What one kind of GPU tries, in order, for each fast path compiled into the blocks.

    Each entry is a trial (export, compile, load, parity against eager) that falls back to the
    next with its reason: `attention` kernels, then `fp8` granularities (bf16 after the last).
    `cublaslt_workspace_kib`: the cuBLASLt workspace, KiB, the plan gives the process
    (`set_cublaslt_workspace`); None leaves torch's. `norm_rope`: whether the blocks compute each head's
    RMS norm and RoPE in norm_rope.py's kernel rather than Inductor's (`resolve_norm_rope`); `row_fp8`:
    whether they make FP8 rows from a `cat` or a GELU in row_fp8.py's kernel (`resolve_row_fp8`).
    """

    name: str  # "sm_90"
    attention: tuple[str, ...]
    fp8: tuple[str, ...]
    why: str  # where the order comes from
    cublaslt_workspace_kib: int | None = None
    # Taken by the plans whose step it was measured in (BENCHMARKS.md, "Each head's norm and RoPE in a kernel
    # of ours"); `norm_rope=on` takes it on any GPU.
    norm_rope: bool = False
    # No plan takes it yet: its step is not measured on a GPU; `row_fp8=on` takes it on any GPU.
    row_fp8: bool = False


# The plan per GPU, keyed by compute capability (major, minor): the first row whose range holds the
# GPU's. Row-wise scaled FP8 measured faster than per tensor on the H200 (see BENCHMARKS.md).
PLANS: tuple[tuple[tuple[int, int], tuple[int, int], Plan], ...] = (
    (
        (9, 0),
        (9, 9),
        Plan(
            "sm_90",
            ("fa3-fp8", "fa3", "sdpa"),
            ("row", "tensor"),
            "Hopper: FA3 runs, FP8 attention and row-wise FP8 first",
            # Without a workspace cuBLASLt runs FLUX.1-dev's large FP8 GEMMs as a stream-K kernel with no
            # 4-byte memset before each: the step took 85.3 and 85.7 against 87.3 and 87.0 ms (H100,
            # 2026-12-07, BENCHMARKS.md "Hopper's plan without cuBLASLt's workspace"); the sm_120 plan's was
            # level (96.0 against 95.4 ms).
            cublaslt_workspace_kib=0,
            # FLUX.1-dev's step 80.6 and 80.8 against 81.8 and 81.5 ms, Z-Image's 61.5 against 63.0 ms, FLUX.2
            # klein's level (H100, 2026-12-07, each against its own run's eager row).
            norm_rope=True,
        ),
    ),
    (
        (12, 0),
        (12, 9),
        Plan(
            "sm_120",
            ("sage", "sdpa"),
            ("row-after", "tensor"),
            "RTX Blackwell (ZeroGPU's RTX Pro 6000): FA3 is a Hopper kernel, 8-bit attention in Triton first; "
            "cuBLAS refuses row-wise scaled FP8 there (pytorch#192707, #161236), so row scales go after the GEMM",
            # Rehearsed on an H100 (`AOT_PLAN=12.0`, SDPA): FLUX.1-dev's step 90.3 against 92.1 ms (2026-12-07).
            # Under sage the heads go to its quantization, and the kernel takes no site (`fuse_norm_rope`).
            norm_rope=True,
        ),
    ),
    (
        (10, 0),
        (11, 9),
        Plan(
            "sm_100",
            ("sage", "sdpa"),
            ("row", "row-after", "tensor"),
            "datacenter Blackwell: FA3 is a Hopper kernel, 8-bit attention in Triton first; row scales after the GEMM "
            "where cuBLAS refuses them in it",
        ),
    ),
    (
        (8, 9),
        (8, 9),
        Plan(
            "sm_89",
            ("sage", "sdpa"),
            ("row-after", "tensor"),
            "Ada: 8-bit attention in Triton first; cuBLAS's row-wise scaled FP8 needs sm_90, "
            "so row scales go after the GEMM",
        ),
    ),
    ((0, 0), (8, 8), Plan("sm_80", ("sdpa",), (), "FP8 needs compute capability >= 8.9")),
)
CPU_PLAN = Plan("cpu", ("sdpa",), (), "no CUDA GPU")


def plan_for(capability: tuple[int, int] | None) -> Plan:
    """The plan for compute capability `capability` (None: no CUDA GPU). Raises `ValueError` for a
    capability no row covers."""
    if capability is None:
        return CPU_PLAN
    for low, high, plan in PLANS:
        if low <= capability <= high:
            return plan
    raise ValueError(f"no plan for compute capability {'.'.join(map(str, capability))}: plans.PLANS")


def forced_plan(options: Options) -> Plan | None:
    """The plan `options.plan` forces (`12.0`), or None for `auto`. Raises `ValueError` for a
    capability no row of `PLANS` covers."""
    if options.plan == "auto":
        return None
    return plan_for(tuple(int(part) for part in options.plan.split(".")))


def resolve_plan(options: Options, device: torch.device) -> tuple[Plan, Decision]:
    """This GPU's plan, or the one `options.plan` forces (`12.0` rehearses ZeroGPU's card on another
    GPU), with its cuBLASLt workspace set for the process (`set_cublaslt_workspace`); the decision
    says which and why. Call it where the real card is (a ZeroGPU worker), before any GEMM there."""
    here = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    gpu = f"{torch.cuda.get_device_name(device)}, sm_{''.join(map(str, here))}" if here else device.type
    plan = forced_plan(options)
    origin = f"forced by plan={options.plan} on {gpu}" if plan else f"auto: {gpu}"
    plan = plan or plan_for(here)
    workspace = set_cublaslt_workspace(plan)
    return plan, Decision("plan", plan.name, "; ".join(filter(None, [origin, plan.why, workspace])))


# torch's variable for the cuBLASLt workspace, in KiB, read at every cuBLASLt call (`set_cublaslt_workspace`).
CUBLASLT_WORKSPACE_SIZE = "CUBLASLT_WORKSPACE_SIZE"


def set_cublaslt_workspace(plan: Plan) -> str:
    """Give this process the plan's cuBLASLt workspace (`Plan.cublaslt_workspace_kib`, KiB) through
    torch's `CUBLASLT_WORKSPACE_SIZE`, unless the environment sets it already: the environment wins,
    so `tools/bench.py --scenarios all@CUBLASLT_WORKSPACE_SIZE=KIB` A/Bs another size. Returns what
    holds, for the plan's decision, or "" where neither sets it.

    torch 2.11 reads the variable at every cuBLASLt call (`at::cuda::getCUDABlasLtWorkspaceSize` parses
    it each time; no static holds it), as the most workspace that call's algorithm may use, so the
    setting holds for every GEMM after it: `Trials.resolve`, which calls this through `resolve_plan`,
    is the first thing compile.py's GPU call does, before any GEMM and any CUDA graph capture. In
    ZeroGPU mode the request workers are forked from the main process, which never sets it; ZeroGPU's
    sm_120 plan sets none.
    """
    held = os.environ.get(CUBLASLT_WORKSPACE_SIZE)
    if held is not None:
        return f"{CUBLASLT_WORKSPACE_SIZE}={held} as set"
    if plan.cublaslt_workspace_kib is None:
        return ""
    os.environ[CUBLASLT_WORKSPACE_SIZE] = str(plan.cublaslt_workspace_kib)
    return f"cuBLASLt workspace {plan.cublaslt_workspace_kib} KiB ({CUBLASLT_WORKSPACE_SIZE})"


@dataclass(frozen=True)
class Walk:
    """One fast path's trials, decided once: what was asked, what to try in order, and how the
    decision it ends in reads. The compile path walks `steps` (`export.compile_blocks`), the load
    path looks for a package of each (`loading.load_packages`); neither reads the options again.

    name: "attention" or "fp8"; asked: the option as given ("auto", "fa3", "fa3-fp8", "sage", "sdpa"; "auto",
    "on", "off"); steps: what to try, in order (attention kernels; FP8 granularities, bf16 after them);
    origin: what chose the steps ("plan sm_90", "requested", "fp8_granularity=row"); notes: the
    plan's steps left out, each with why; off: why there are no steps (fp8 off); required: asked
    for explicitly (`fp8=on`): a failed last step raises, and no error bound sends a block back to bf16.
    """

    name: str
    asked: str
    steps: tuple[str, ...]
    origin: str
    notes: tuple[str, ...] = ()
    off: str = ""
    required: bool = False

    def decision(self, value: str, walked: list[str]) -> Decision:
        """The decision the walk ended in: `value`, reasoned by the notes and the steps `walked`
        (each step's note, in order), or by `off` where there were no steps."""
        reason = f"{self.origin}: " + " -> ".join([*self.notes, *walked]) if self.steps else self.off
        return Decision(self.name, value, reason)


def attention_walk(options: Options, plan: Plan, transformer: torch.nn.Module, device: torch.device) -> Walk:
    """The attention kernels to trial, in order (the plan's with `auto`, else the one asked for),
    with a note for each of the plan's kernels left out: FA3 only where `resolve_attention`'s checks
    pass (Hopper, dtype, head dim, a kernel that loads), `fa3-fp8` only where the blocks' norms
    bound Q and K (`fa3.unit_scale_problem`), `sage` only where `sage_problem` finds none. Decided
    before any capture, so the load path never looks for packages of a kernel left out.

    Raises:
        RuntimeError: `attention=fa3`, `fa3-fp8` or `sage` was asked for and cannot run (`resolve_attention`).
    """
    if options.attention != "auto":
        kernel = resolve_attention(options, transformer, device).value
        return Walk("attention", options.attention, (kernel,), "requested")
    kernels, skipped = list(plan.attention), []
    if set(FA3_KERNELS) & set(kernels):
        checked = resolve_attention(options, transformer, device)
        if checked.value not in FA3_KERNELS:
            for kernel in [k for k in kernels if k in FA3_KERNELS]:
                kernels.remove(kernel)
                skipped.append(f"{kernel} skipped ({checked.reason.removeprefix('auto: ')})")
    if "fa3-fp8" in kernels:
        problem = _unscaled_problem(transformer)
        if problem:
            kernels.remove("fa3-fp8")
            skipped.append(f"fa3-fp8 skipped ({problem})")
    if "sage" in kernels:
        problem = sage_problem(transformer, device)
        if problem:
            kernels.remove("sage")
            skipped.append(f"sage skipped ({problem})")
    return Walk("attention", "auto", tuple(kernels or ["sdpa"]), f"plan {plan.name}", tuple(skipped))


def fp8_walk(options: Options, plan: Plan, device: torch.device) -> Walk:
    """The FP8 granularities to trial, in order, bf16 after them (the plan's with
    `fp8_granularity=auto`, else the one asked for), or none with the reason FP8 is off.

    Raises:
        RuntimeError: `fp8=on` was asked for and cannot run here or under the plan.
    """
    required, chosen = options.fp8 == "on", options.fp8_granularity != "auto"
    origin = f"fp8_granularity={options.fp8_granularity}" if chosen else f"plan {plan.name}"
    checked = resolve_fp8(options, device)
    if checked.value == "off":
        return Walk("fp8", options.fp8, (), origin, off=checked.reason)
    if chosen:
        return Walk("fp8", options.fp8, (options.fp8_granularity,), origin, required=required)
    if not plan.fp8:
        if required:
            raise RuntimeError(f"fp8=on cannot run: plan {plan.name} has no FP8 ({plan.why}). Use --fp8 auto or off.")
        return Walk("fp8", options.fp8, (), origin, off=f"auto: plan {plan.name}: {plan.why}")
    return Walk("fp8", options.fp8, plan.fp8, origin, required=required)


@dataclass(frozen=True)
class Trials:
    """What the blocks try on this GPU, in order, worked out once per GPU call (`resolve`) and handed
    to the load path (`loading.load_packages`: the variants a compile here would make) and the
    compile path (`export.compile_blocks`: the trials it walks), so both come to the same answer.

    planned: the decision naming the GPU's plan (`resolve_plan`); attention, fp8: each fast path's
    walk (`attention_walk`, `fp8_walk`); graphs: whether the step runs as CUDA graphs on the
    device the transformer is on (`resolve_cuda_graphs`); fa3_kernel: where FA3 is loaded from
    (`fa3.load_fa3`), for packages that call it; norm_rope, row_fp8: whether the packages compute each
    head's norm and RoPE in norm_rope.py's kernel (`resolve_norm_rope`), and FP8 rows from a `cat` or a
    GELU in row_fp8.py's (`resolve_row_fp8`).
    """

    planned: Decision
    attention: Walk
    fp8: Walk
    graphs: Decision
    fa3_kernel: str
    norm_rope: Decision
    row_fp8: Decision

    @property
    def ours(self) -> frozenset[str]:
        """The kernels of ours the packages compute with: "norm_rope", "row_fp8" where on
        (`lowering.compile_package`)."""
        return frozenset(d.name for d in (self.norm_rope, self.row_fp8) if d.value == "on")

    @classmethod
    def resolve(cls, options: Options, transformer: torch.nn.Module) -> Trials:
        """The trials for `transformer` on the device it is on, under `options`. Call it where the
        real card is (a ZeroGPU worker).

        Raises:
            RuntimeError: a fast path explicitly requested in `options` cannot run here.
            ValueError: `options.plan` names a capability no row of `PLANS` covers.
        """
        device = transformer.device
        plan, planned = resolve_plan(options, device)
        attention = attention_walk(options, plan, transformer, device)
        fp8 = fp8_walk(options, plan, device)
        graphs, norm_rope = resolve_cuda_graphs(options, device), resolve_norm_rope(options, plan)
        return cls(planned, attention, fp8, graphs, options.fa3_kernel, norm_rope, resolve_row_fp8(options, plan))


@dataclass(frozen=True)
class Decision:
    """One resolved choice, e.g. `attention: sdpa (auto: no CUDA device)`.

    name: the fast path; value: what it resolved to; reason: why; asked: what the options asked
    for, where a later step reads it (`cuda_graphs`: `apply_` captures strictly under `on`); ""
    elsewhere (a `Walk` carries what was asked of attention and FP8; saved packages record no `asked`).
    """

    name: str
    value: str
    reason: str
    asked: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.value} ({self.reason})"


def one_line(text: str, limit: int) -> str:
    """`text` on one line, cut to `limit` characters: a reason from an exception or a file (Inductor
    errors run to pages; names from a file may hold newlines)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def brief(exc: BaseException) -> str:
    """`Type: message` on one line, at most 300 characters: a trial's failure in a decision's reason."""
    return one_line(f"{type(exc).__name__}: {exc}", 300)


def _cuda_problem(device: torch.device, min_capability: tuple[int, int], what: str) -> str | None:
    if device.type != "cuda":
        return f"{what} needs a CUDA GPU; the pipeline is on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < min_capability:
        have, need = ".".join(map(str, capability)), ".".join(map(str, min_capability))
        return f"{what} needs compute capability >= {need}; {torch.cuda.get_device_name(device)} has {have}"
    return None


def _hopper_problem(device: torch.device) -> str | None:
    """Why FA3 cannot run on this CUDA device (FA3 is a Hopper kernel), or None."""
    capability = torch.cuda.get_device_capability(device)
    if capability[0] == 9:
        return None
    have = ".".join(map(str, capability))
    return f"FA3 is built for Hopper (compute capability 9.x); {torch.cuda.get_device_name(device)} has {have}"


def refuse_impossible_requests(options: Options, device: torch.device) -> None:
    """Raise now, before any weight is loaded, for an explicit fast path this machine cannot run.

    Checks what needs no model: `attention=fa3` (a Hopper GPU), `attention=sage` and `fp8=on` (compute capability
    >= 8.9), `cuda_graphs=on` (CUDA). A ZeroGPU main process has emulated CUDA whose capability is
    a table in `spaces`, not the card: there only the device type is checked, and the GPU worker
    decides the rest (`resolve_attention`, `resolve_fp8`).

    Raises:
        RuntimeError: the message the full decision would give later.
        ValueError: a forced `plan` that no row of `PLANS` covers.
    """
    forced_plan(options)  # a capability no row covers raises now, not in the GPU call
    emulated = device.type == "cuda" and ON_ZEROGPU
    if options.attention in FA3_KERNELS and not emulated:
        problem = _cuda_problem(device, (9, 0), "FA3") or _hopper_problem(device)
        if problem:
            raise RuntimeError(f"attention={options.attention} cannot run: {problem}. Use --attention auto or sdpa.")
    if options.attention == "sage" and not emulated:
        problem = _cuda_problem(device, SAGE_MIN_CAPABILITY, "sage attention")
        if problem:
            raise RuntimeError(f"attention=sage cannot run: {problem}. Use --attention auto or sdpa.")
    if options.fp8 == "on" and not emulated:
        resolve_fp8(options, device)
    if options.cuda_graphs == "on":
        resolve_cuda_graphs(options, device)


def _unscaled_problem(transformer: torch.nn.Module) -> str | None:
    """Why `fa3-fp8` cannot run on `transformer` (a block's norms do not bound its queries and
    keys: `fa3.unit_scale_problem`), or None."""
    problem = unit_scale_problem(transformer)
    return problem and f"Q and K cannot be cast to FP8 unscaled: {problem}"


def resolve_attention(options: Options, transformer: torch.nn.Module, device: torch.device) -> Decision:
    """Decide the attention kernel compiled into the blocks; loads FA3 to prove it can run.

    Returns `fa3` (or `fa3-fp8` where asked for) only on compute capability 9.x (FA3 is a Hopper
    kernel) with a bfloat16/float16 transformer, a head dim FA3 supports (<= 256, multiple of 8)
    and a kernel that loads; `fa3-fp8` also where every block's norms bound its queries and keys
    (`fa3.unit_scale_problem`).

    `sage` only where asked for, and where `sage_problem` finds none.

    Raises:
        RuntimeError: `attention=fa3`, `fa3-fp8` or `sage` was asked for and one of those conditions fails.
    """
    if options.attention == "sdpa":
        return Decision("attention", "sdpa", "requested")
    if options.attention == "sage":
        problem = sage_problem(transformer, device)
        if problem:
            raise RuntimeError(f"attention=sage cannot run: {problem}. Use --attention auto or sdpa.")
        return Decision("attention", "sage", "requested")
    head_dim = attention_head_dim(transformer)
    problem = _cuda_problem(device, (9, 0), "FA3") or _hopper_problem(device)
    if problem is None and transformer.dtype not in (torch.bfloat16, torch.float16):
        problem = f"FA3 supports bfloat16/float16, the transformer is {transformer.dtype}"
    if problem is None and (head_dim > FA3_MAX_HEAD_DIM or head_dim % 8):
        problem = f"FA3 supports head dims <= {FA3_MAX_HEAD_DIM} in multiples of 8, this model has {head_dim}"
    if problem is None:
        try:
            load_fa3(options.fa3_kernel)
        except Exception as exc:  # a missing package, no network, no build for this torch version
            problem = f"FA3 kernel {options.fa3_kernel!r} did not load: {type(exc).__name__}: {exc}"
    if problem is None and options.attention == "fa3-fp8":
        problem = _unscaled_problem(transformer)
    if problem is None:
        kernel = options.attention if options.attention in FA3_KERNELS else "fa3"
        return Decision("attention", kernel, f"{options.attention}: {options.fa3_kernel}")
    if options.attention in FA3_KERNELS:
        raise RuntimeError(f"attention={options.attention} cannot run: {problem}. Use --attention auto or sdpa.")
    return Decision("attention", "sdpa", f"auto: {problem}")


# Triton's FP8 matmuls (the kernel's P·V) need compute capability 8.9 (Ada) or later.
SAGE_MIN_CAPABILITY = (8, 9)


def sage_problem(transformer: torch.nn.Module, device: torch.device) -> str | None:
    """Why `sage` attention (sage.py) cannot run for `transformer` on `device`, or None: it needs a
    CUDA GPU of compute capability >= 8.9, a bfloat16/float16 transformer and a head dim its tiles
    take (`sage.head_dim_problem`). Whether Triton compiles it there is left to the trial."""
    problem = _cuda_problem(device, SAGE_MIN_CAPABILITY, "sage attention")
    if problem is None and transformer.dtype not in (torch.bfloat16, torch.float16):
        problem = f"sage attention takes bfloat16/float16, the transformer is {transformer.dtype}"
    return problem or head_dim_problem(attention_head_dim(transformer))


def resolve_fp8(options: Options, device: torch.device) -> Decision:
    """Decide whether the blocks' linear layers run in FP8 (needs compute capability >= 8.9).

    Raises:
        RuntimeError: `fp8=on` was asked for on a device that cannot run it.
    """
    if options.fp8 == "off":
        return Decision("fp8", "off", "requested")
    return _on_off_auto("fp8", options.fp8, _cuda_problem(device, (8, 9), "FP8"))


def resolve_cuda_graphs(options: Options, device: torch.device) -> Decision:
    """Decide whether the transformer step runs through CUDA graphs (`graphs.py`).

    Looks only at the device type, so it is safe in a ZeroGPU main process (no CUDA call).

    Raises:
        RuntimeError: `cuda_graphs=on` was asked for and the transformer is not on a CUDA device.
    """
    if options.cuda_graphs == "off":
        return Decision("cuda_graphs", "off", "requested", "off")
    problem = None if device.type == "cuda" else f"CUDA graphs need a CUDA GPU; the pipeline is on {device.type}"
    return _on_off_auto("cuda_graphs", options.cuda_graphs, problem)


def resolve_norm_rope(options: Options, plan: Plan) -> Decision:
    """Decide whether the packages compute each head's RMS norm and RoPE in norm_rope.py's Triton kernel
    (`norm_rope_sites.fuse_norm_rope`): as asked, or with `auto` as the plan says (`Plan.norm_rope`). Where a
    package is compiled for a CPU, the kernel's place is taken by its torch reference, which Inductor
    compiles as its own ops."""
    return _ours("norm_rope", options.norm_rope, plan.norm_rope, plan, "each head's norm and RoPE")


def resolve_row_fp8(options: Options, plan: Plan) -> Decision:
    """Decide whether the packages make the FP8 rows of a `cat` or a GELU in row_fp8.py's Triton kernel
    (`row_fp8_sites.fuse_row_fp8`): as asked, or with `auto` as the plan says (`Plan.row_fp8`). Where a
    package is compiled for a CPU, the kernel's place is taken by its torch reference."""
    return _ours("row_fp8", options.row_fp8, plan.row_fp8, plan, "the FP8 rows of a cat or a GELU")


def _ours(name: str, requested: str, planned: bool, plan: Plan, what: str) -> Decision:
    """A kernel of ours, on or off: as `requested`, or (`auto`) as `planned` by `plan`; `what` it computes."""
    if requested != "auto":
        return Decision(name, requested, "requested", requested)
    if planned:
        return Decision(name, "on", f"auto: plan {plan.name}", "auto")
    return Decision(name, "off", f"auto: plan {plan.name} leaves {what} to Inductor", "auto")


def _on_off_auto(name: str, requested: str, problem: str | None) -> Decision:
    """`on` or `auto` (not `off`): on without a problem; else `on` raises with it, `auto` falls back."""
    if problem is None:
        return Decision(name, "on", requested, requested)
    if requested == "on":
        raise RuntimeError(f"{name}=on cannot run: {problem}. Use --{name.replace('_', '-')} auto or off.")
    return Decision(name, "off", f"auto: {problem}", requested)

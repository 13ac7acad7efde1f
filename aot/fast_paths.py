"""The fast paths: FlashAttention-3 and FP8 inside the compiled blocks, CUDA graphs around the step,
each resolved to a `Decision`, in the order the GPU's `Plan` gives (`PLANS`, keyed by compute
capability; `export.compile_blocks` runs each step as a trial and walks to the next on failure).

`auto` takes a fast path only where it can run and says why not otherwise; an explicit request
that cannot run raises with what is missing. Off Hopper (an RTX Pro 6000 Blackwell on ZeroGPU, an
A100, an L40S) attention is torch's SDPA, which picks its fastest kernel for the GPU at hand.
Nothing here runs at import: capability probes and kernel loads happen inside
`export.compile_blocks` and at a compiled block's first call, in the GPU worker on ZeroGPU
(zerogpu.py says what runs where).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from aot.families import attention_head_dim
from aot.options import Options
from aot.zerogpu_limits import ON_ZEROGPU

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


@dataclass(frozen=True)
class Plan:
    """What one kind of GPU tries, in order, for each fast path compiled into the blocks.

    Each entry is a trial (export, compile, load, parity against eager) that falls back to the
    next with its reason: `attention` kernels, then `fp8` granularities (bf16 after the last).
    """

    name: str  # "sm_90"
    attention: tuple[str, ...]
    fp8: tuple[str, ...]
    why: str  # where the order comes from


# The plan per GPU, keyed by compute capability (major, minor): the first row whose range holds the
# GPU's. Row-wise scaled FP8 measured faster than per tensor on the H200 (see BENCHMARKS.md).
PLANS: tuple[tuple[tuple[int, int], tuple[int, int], Plan], ...] = (
    ((9, 0), (9, 9), Plan("sm_90", ("fa3", "sdpa"), ("row", "tensor"), "Hopper: FA3 runs, row-wise FP8 first")),
    (
        (12, 0),
        (12, 9),
        Plan(
            "sm_120",
            ("sdpa",),
            ("tensor",),
            "RTX Blackwell (ZeroGPU's RTX Pro 6000): FA3 is a Hopper kernel; cuBLAS refuses row-wise scaled FP8 "
            "there (pytorch#192707, #161236)",
        ),
    ),
    ((10, 0), (11, 9), Plan("sm_100", ("sdpa",), ("row", "tensor"), "datacenter Blackwell: FA3 is a Hopper kernel")),
    ((8, 9), (8, 9), Plan("sm_89", ("sdpa",), ("tensor",), "Ada: torch's row-wise scaled FP8 needs sm_90")),
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
    raise ValueError(f"no plan for compute capability {'.'.join(map(str, capability))}: fast_paths.PLANS")


def forced_plan(options: Options) -> Plan | None:
    """The plan `options.plan` forces (`12.0`), or None for `auto`. Raises `ValueError` for a
    capability no row of `PLANS` covers."""
    if options.plan == "auto":
        return None
    return plan_for(tuple(int(part) for part in options.plan.split(".")))


def resolve_plan(options: Options, device: torch.device) -> tuple[Plan, Decision]:
    """This GPU's plan, or the one `options.plan` forces (`12.0` rehearses ZeroGPU's card on another
    GPU); the decision says which and why. Call it where the real card is (a ZeroGPU worker)."""
    here = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    gpu = f"{torch.cuda.get_device_name(device)}, sm_{''.join(map(str, here))}" if here else device.type
    plan = forced_plan(options)
    if plan is None:
        plan = plan_for(here)
        return plan, Decision("plan", plan.name, f"auto: {gpu}; {plan.why}")
    return plan, Decision("plan", plan.name, f"forced by plan={options.plan} on {gpu}; {plan.why}")


def attention_steps(
    options: Options, plan: Plan, transformer: torch.nn.Module, device: torch.device
) -> tuple[list[str], list[str]]:
    """The attention kernels to trial, in order (the plan's with `auto`, else the one asked for),
    and a note for each of the plan's kernels left out: FA3 only where `resolve_attention`'s checks
    pass (Hopper, dtype, head dim, a kernel that loads).

    Raises:
        RuntimeError: `attention=fa3` was asked for and cannot run (`resolve_attention`).
    """
    if options.attention != "auto":
        return [resolve_attention(options, transformer, device).value], []
    kernels, skipped = list(plan.attention), []
    if "fa3" in kernels:
        checked = resolve_attention(options, transformer, device)
        if checked.value != "fa3":
            kernels.remove("fa3")
            skipped.append(f"fa3 skipped ({checked.reason.removeprefix('auto: ')})")
    return kernels or ["sdpa"], skipped


def fp8_steps(options: Options, plan: Plan, device: torch.device) -> tuple[list[str], str]:
    """The FP8 granularities to trial, in order, bf16 after them (the plan's with
    `fp8_granularity=auto`, else the one asked for), and the reason FP8 is off where the list is empty.

    Raises:
        RuntimeError: `fp8=on` was asked for and cannot run here or under the plan.
    """
    checked = resolve_fp8(options, device)
    if checked.value == "off":
        return [], checked.reason
    if options.fp8_granularity != "auto":
        return [options.fp8_granularity], ""
    if not plan.fp8:
        if options.fp8 == "on":
            raise RuntimeError(f"fp8=on cannot run: plan {plan.name} has no FP8 ({plan.why}). Use --fp8 auto or off.")
        return [], f"auto: plan {plan.name}: {plan.why}"
    return list(plan.fp8), ""


@dataclass(frozen=True)
class Trials:
    """What the blocks try on this GPU, in order, worked out once per GPU call (`resolve`) and handed
    to the load path (`packages.load_packages`: the variants a compile here would make) and the
    compile path (`export.compile_blocks`: the trials it walks), so both come to the same answer.

    plan: the GPU's plan, and `planned` the decision naming it; attention: the kernels to trial
    (`attention_steps`), `skipped` a note for each of the plan's left out; fp8: the granularities
    to trial, bf16 after them (`fp8_steps`), `fp8_off` why there are none; graphs: whether the
    step runs as CUDA graphs on the device the transformer is on (`resolve_cuda_graphs`).
    """

    plan: Plan
    planned: Decision
    attention: tuple[str, ...]
    skipped: tuple[str, ...]
    fp8: tuple[str, ...]
    fp8_off: str
    graphs: Decision

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
        kernels, skipped = attention_steps(options, plan, transformer, device)
        granularities, fp8_off = fp8_steps(options, plan, device)
        graphs = resolve_cuda_graphs(options, device)
        return cls(plan, planned, tuple(kernels), tuple(skipped), tuple(granularities), fp8_off, graphs)


@dataclass(frozen=True)
class Decision:
    """One resolved choice, e.g. `attention: sdpa (auto: no CUDA device)`.

    name: the fast path; value: what it resolved to; reason: why; asked: what the options asked
    for (`auto`, `on`, `fa3`, ...; "" where not recorded, as in packages saved before it was).
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

    Checks what needs no model: `attention=fa3` (a Hopper GPU), `fp8=on` (compute capability
    >= 8.9), `cuda_graphs=on` (CUDA). A ZeroGPU main process has emulated CUDA whose capability is
    a table in `spaces`, not the card: there only the device type is checked, and the GPU worker
    decides the rest (`resolve_attention`, `resolve_fp8`).

    Raises:
        RuntimeError: the message the full decision would give later.
        ValueError: a forced `plan` that no row of `PLANS` covers.
    """
    forced_plan(options)  # a capability no row covers raises now, not in the GPU call
    emulated = device.type == "cuda" and ON_ZEROGPU
    if options.attention == "fa3" and not emulated:
        problem = _cuda_problem(device, (9, 0), "FA3") or _hopper_problem(device)
        if problem:
            raise RuntimeError(f"attention=fa3 cannot run: {problem}. Use --attention auto or sdpa.")
    if options.fp8 == "on" and not emulated:
        resolve_fp8(options, device)
    if options.cuda_graphs == "on":
        resolve_cuda_graphs(options, device)


def resolve_attention(options: Options, transformer: torch.nn.Module, device: torch.device) -> Decision:
    """Decide the attention kernel compiled into the blocks; loads FA3 to prove it can run.

    Returns `fa3` only on compute capability 9.x (FA3 is a Hopper kernel) with a bfloat16/float16
    transformer, a head dim FA3 supports (<= 256, multiple of 8) and a kernel that loads.

    Raises:
        RuntimeError: `attention=fa3` was asked for and one of those conditions fails.
    """
    if options.attention == "sdpa":
        return Decision("attention", "sdpa", "requested")
    head_dim = attention_head_dim(transformer)
    problem = _cuda_problem(device, (9, 0), "FA3") or _hopper_problem(device)
    if problem is None and transformer.dtype not in (torch.bfloat16, torch.float16):
        problem = f"FA3 supports bfloat16/float16, the transformer is {transformer.dtype}"
    if problem is None and (head_dim > 256 or head_dim % 8):
        problem = f"FA3 supports head dims <= 256 in multiples of 8, this model has {head_dim}"
    if problem is None:
        try:
            load_fa3(options.fa3_kernel)
        except Exception as exc:  # a missing package, no network, no build for this torch version
            problem = f"FA3 kernel {options.fa3_kernel!r} did not load: {type(exc).__name__}: {exc}"
    if problem is None:
        return Decision("attention", "fa3", f"{options.attention}: {options.fa3_kernel}")
    if options.attention == "fa3":
        raise RuntimeError(f"attention=fa3 cannot run: {problem}. Use --attention auto or sdpa.")
    return Decision("attention", "sdpa", f"auto: {problem}")


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


def _on_off_auto(name: str, requested: str, problem: str | None) -> Decision:
    """`on` or `auto` (not `off`): on without a problem; else `on` raises with it, `auto` falls back."""
    if problem is None:
        return Decision(name, "on", requested, requested)
    if requested == "on":
        raise RuntimeError(f"{name}=on cannot run: {problem}. Use --{name.replace('_', '-')} auto or off.")
    return Decision(name, "off", f"auto: {problem}", requested)


@functools.cache
def load_fa3(source: str) -> Any:
    """Load FlashAttention-3 and hand it to diffusers' `_flash_3` attention backend.

    `source` is a Hub kernel repo (`owner/name`, fetched by `kernels.get_kernel` at
    `FA3_KERNEL_VERSION`) or the name of an importable module providing `flash_attn_func`
    (e.g. `fa3_fwd_interface` from the PyPI wheel `fa3-fwd`). The backend calls it through the
    registered custom op `_diffusers_flash_attn_3::_flash_attn_forward`, which has a fake
    implementation, so a block exports as one graph and the package calls that op at run time.

    Loads once per process (a failed load is tried again at the next call).

    Raises:
        ImportError, OSError, RuntimeError: the kernel cannot be found or loaded.
    """
    from diffusers.models import attention_dispatch

    if "/" in source:
        from kernels import get_kernel

        module = get_kernel(source, version=FA3_KERNEL_VERSION)
    else:
        import importlib

        module = importlib.import_module(source)
    # diffusers looks for FA3 only once, as a module named `flash_attn_interface` at its import;
    # these two names are what that detection sets.
    attention_dispatch.flash_attn_3_func = module.flash_attn_func
    attention_dispatch._CAN_USE_FLASH_ATTN_3 = True
    return module


# kernels-community/flash-attn3's major version: the one diffusers 0.42 pins for its FA3 backend.
FA3_KERNEL_VERSION = 1


def fp8_config(granularity: str) -> Any:
    """torchao's FP8 dynamic-activation, FP8-weight config at `granularity` ("row" or "tensor").

    `set_inductor_config=False`: Inductor settings live in `INDUCTOR_CONFIGS`, not in a global
    that quantizing changes.
    """
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

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
    from torchao.quantization import quantize_

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
    handles = []
    for name, module in block.named_modules():
        if isinstance(module, torch.nn.Linear):

            def record(module, args, kwargs, name=name):
                x = args[0] if args else kwargs.get("input")
                if isinstance(x, torch.Tensor) and x.dim():
                    count = x.numel() // x.shape[-1]
                    rows[name] = min(count, rows.get(name, count))

            handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    try:
        yield rows
    finally:
        for handle in handles:
            handle.remove()


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
    from torchao.quantization import PerRow

    granularity = getattr(config, "granularity", None)
    return any(
        isinstance(g, PerRow) for g in (granularity if isinstance(granularity, (list, tuple)) else [granularity])
    )

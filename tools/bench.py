"""Benchmark regional AoT against eager, every scenario in one run.

By default the pipeline has FLUX.1-dev's published component configs and seeded random weights (no
download), so the numbers are about shapes and kernels, not image quality; `--model` takes a real
one. Each group of scenarios runs in a fresh process with empty Inductor and Triton caches (a cold
Space start), and the groups run one after another on the same GPU. Per scenario:

    step ms      median of the transformer's forward (CUDA events, after warm-up), as the template
                 runs it: compiled scenarios on CUDA replay it as a CUDA graph (graphs.py)
    speedup      eager step ms / step ms, eager measured in this run
    steps queued the step's ms with 8 calls queued back to back, as a pipeline calls them (the host
                 prepares the next while the GPU runs this one), and eager's queued ms / it
    without CUDA graphs   the same compiled step called plainly, and the graph replay's relative
                 error against it on inputs other than the captured ones
    s / image    one generation: text encoders + all steps + VAE decode (warm: + writing the PNG
                 file app.run returns)
    ready s      compile: regional compile from scratch (* = second compile in its process);
                 warm start: load + verify + apply the saved packages and run the first step
    ISA probe s  the wait for torch's CPU ISA probe before the first compile of a process where the
                 compile needs it (on a CPU; portability.needs_probe), - on CUDA; a Space runs it
                 while loading the weights; not part of ready s
    peak GiB     peak allocated GPU memory during that generation
    kernels      where one plain step's GPU time goes (CUDA only, torch.profiler): attention, GEMM and
                 other kernels' ms by kernel name (`kernel_kind`), and the line keeps each kind's `--top`
                 longest; the rest of the step is time between kernels
    graphed step one CUDA graph replay under torch.profiler (`timeline`): the GPU's busy time, the time
                 between its operations and the part of it at memsets; the profiler slows the replay, so
                 its span is not the step's time
    rel. error   ||latents - eager latents|| / ||eager latents|| after all steps, same seed

`warm` is the Space itself: app.py started with the packages `all` saved (AOT_LOAD), then
app.run() on real prompts. `zerogpu` is the Space as ZeroGPU runs it, under
zerogpu_harness.py (the real spaces package, forked GPU workers, weights packed to disk at launch):
ready s is the startup compile in a worker plus applying its packages here; then /generate through
gradio_client: the first request on a new worker, warm requests, and the step as the worker runs it.
`peer` and `peer-tensor` are what a diffusers user would write instead (`compile_like_diffusers`:
torchao FP8 per row or per tensor, FA3 through diffusers' dispatcher, `compile_repeated_blocks`);
ready s is their first step, where torch.compile compiles; they run on CUDA only (FA3, FP8).
A variant, `SCENARIO@VAR=VALUE[@VAR=VALUE...]` (e.g. `all@CUBLASLT_WORKSPACE_SIZE=32768`), runs that
scenario in a process of its own with those environment variables set, after the other groups: an A/B of
an engine option (AOT_*), an Inductor or a CUDA library setting against the same eager row.
It prints a markdown table, then one JSON line (date, GPU, versions, commit, rows) last, and appends
that line to benchmarks/results.jsonl (`--results`). `--keep DIR` keeps the run's work folder: each group's
Inductor cache (caches/GROUP/inductor) holds its kernels' sources (Triton's on a GPU), beside the
configurations autotuning chose (`*.best_config`), and packages/ what `all` saved.

`--family NAME` measures another family at its published transformer shapes: the tiny pipeline
assets/tiny-NAME/ with its transformer replaced by one built from `PUBLISHED_TRANSFORMER` in
assets/make_tiny_NAME.py (dashes as underscores) with seeded random bf16 weights, a VAE with that
transformer's latent channels, and the tiny text encoders' outputs widened to the transformer's
text widths (seeded random values, the same in every scenario): the text encoders do not matter
for the transformer's step, which is what is measured. `--layers N` cuts every block stack to N
blocks and `--heads N` the attention heads to N (a smoke run on a CPU).

From the repo root (the engine, aot/, is imported from there):

    python -m tools.bench                              # everything, 1024x1024, 28 steps
    python -m tools.bench --scenarios eager,aot --steps 8
    python -m tools.bench --family z-image --scenarios eager,all --steps 8
    python -m tools.bench --scenarios eager,all --keep /tmp/bench-run   # ... and keep its kernels
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from PIL import Image

from aot import portability
from aot.blocks import forward_signature, rel_error, repeated_blocks, unpatch_forward
from aot.compiled import Report
from aot.export import capture, capture_blocks
from aot.fa3 import load_fa3
from aot.families import family
from aot.graphs import GraphedStep, graph_step_
from aot.model_config import latent_channels, with_latent_channels
from aot.options import Options
from aot.pipeline import load_pipeline

ROOT = Path(__file__).resolve().parents[1]
# FLUX.1-dev's published configs (black-forest-labs/FLUX.1-dev, */config.json), weights random; its
# transformer's is `published_transformer("flux")`.
CLIP = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    projection_dim=768,
)
T5 = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dense_act_fn="gelu_new",
    is_gated_act=True,
    layer_norm_epsilon=1e-6,
)
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# Scenarios add one piece each to the options from the environment (AOT_FA3_KERNEL, ...); `all` is
# the template's default: everything `auto`. Each group runs in its own process.
SCENARIOS = {
    "eager": None,
    "aot": dict(attention="sdpa", fp8="off"),
    "aot+fa3": dict(attention="fa3", fp8="off"),
    "aot+fp8": dict(attention="sdpa", fp8="on"),
    "all": dict(),
    # bf16 FA3 in place of the plan's FP8 attention, everything else as `all`.
    "fa3": dict(attention="fa3"),
    # ZeroGPU's card (an RTX Pro 6000, sm_120) rehearsed: its plan of trials (sage or SDPA; FP8 row-wise with
    # its scales after the GEMM, then per tensor).
    "sm120": dict(plan="12.0"),
}
# aot and aot+fa3 share bf16 weights; FP8 quantizes in place, so those scenarios get a process each
# (AOTInductor keeps user-managed constants alive after a runner is dropped, torch#194480).
GROUPS = [["eager", "aot", "aot+fa3"], ["aot+fp8"], ["all"], ["fa3"], ["sm120"], ["warm"]]
GROUPS += [["zerogpu"], ["zerogpu-eager"], ["lora"], ["peer"], ["peer-tensor"]]
# What a diffusers user would pick instead, each quantized in place in its own process
# (`compile_like_diffusers`): FP8 per row as ours, and per tensor (flux-fast's and flux-fp8-api's recipe).
PEERS = {"peer": "row", "peer-tensor": "tensor"}
ZEROGPU = ("zerogpu", "zerogpu-eager")  # the Space in ZeroGPU mode, compiled (everything auto) and eager
# A `--scenarios` entry may be a variant of one of these: `all@CUBLASLT_WORKSPACE_SIZE=32768@AOT_FP8=off` runs
# `all` in a process of its own with those environment variables set (`variant`): an A/B of any setting,
# in one run, against one eager row.
VARIANT_OF = (*SCENARIOS, *PEERS)
# The `lora` scenario's LoRA: rank 16 on the block layers the family row names (`lora_targets`).
LORA_RANK = 16
PROMPTS = ["a photo of a red fox in fresh snow, morning light", "an isometric pixel-art lighthouse at dusk"]
RANDOM = "random-flux-dev"


def variant(spec: str) -> tuple[str, dict[str, str]]:
    """The scenario of a `--scenarios` entry and the environment variables its variant sets:
    "all" -> ("all", {}); "all@CUBLASLT_WORKSPACE_SIZE=32768" -> ("all", {"CUBLASLT_WORKSPACE_SIZE": "32768"}).
    A value cannot hold a comma or "@" (they separate entries and settings).

    Raises:
        ValueError: a setting that is not NAME=VALUE (NAME letters, digits and underscores, not
            starting with a digit), or settings on a scenario not in `VARIANT_OF` (warm, zerogpu and
            lora measure what an earlier group or the harness made, in processes of their own).
    """
    name, *settings = spec.split("@")
    env = {}
    for setting in settings:
        key, equals, value = setting.partition("=")
        if not equals or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{spec}: {setting!r} is not NAME=VALUE (an environment variable and its value)")
        env[key] = value
    if env and name not in VARIANT_OF:
        raise ValueError(f"{spec}: a variant (SCENARIO@VAR=VALUE) is of one of {', '.join(VARIANT_OF)}")
    return name, env


def random_transformer(device: str) -> torch.nn.Module:
    """FLUX.1-dev's transformer with seeded random bf16 weights (the same weights every call)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        return FluxTransformer2DModel(**published_transformer("flux")).to(torch.bfloat16).eval()


def random_flux_dev(device: str):
    """A FluxPipeline with FLUX.1-dev's component configs and seeded random bf16 weights."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    sys.path.insert(0, str(ROOT / "assets"))
    from make_tiny_flux import SCHEDULER, clip_tokenizer, t5_tokenizer  # ids stay below the vocab sizes

    torch.manual_seed(0)
    with torch.device(device):  # eval(): as from_pretrained leaves them (T5's dropout off)
        text_encoder = CLIPTextModel(CLIPTextConfig(**CLIP)).to(torch.bfloat16).eval()
        text_encoder_2 = T5EncoderModel(T5Config(**T5)).to(torch.bfloat16).eval()
        vae = AutoencoderKL(**VAE).to(torch.bfloat16).eval()
    return FluxPipeline(
        transformer=random_transformer(device),
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=clip_tokenizer(),
        tokenizer_2=t5_tokenizer(),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    )


def random_flux_dev_on_cpu():
    """`random_flux_dev`'s pipeline built on the CPU in seconds, its weights from `fill_random_` (no
    initializers run: 17B values through torch's serial CPU generator took minutes). Other random
    weights than `random_flux_dev`'s: for timings, not for errors."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        pipe = random_flux_dev("cpu")
    fill_random_([pipe.transformer, pipe.text_encoder, pipe.text_encoder_2, pipe.vae], "cpu")
    return pipe


def fill_random_(modules: list[torch.nn.Module], device: str) -> None:
    """Give every meta-device parameter of `modules` a value on `device`, in seconds at any size:
    2-d and larger weights are cut from one seeded pool of uniform values scaled by 1/sqrt(fan-in)
    (10B+ values through torch's serial CPU generator take minutes), 1-d weights (norm scales) are 1,
    biases 0. Buffers stay the modules' own."""
    size = 2**24
    generator = torch.Generator(device).manual_seed(0)
    pool = (torch.rand(size, generator=generator, device=device) * 2 - 1).to(torch.bfloat16).repeat(2)
    start = 0
    for component in modules:
        for module in component.modules():
            for name, param in list(module._parameters.items()):
                if param is None or param.device.type != "meta":
                    continue
                value = torch.empty(param.shape, dtype=param.dtype, device=device)
                if param.dim() >= 2:
                    flat = value.view(-1)
                    for begin in range(0, flat.numel(), size):
                        piece = flat[begin : begin + size]
                        piece.copy_(pool[start : start + piece.numel()])
                        start = (start + 7919) % size
                    value.mul_(param[0].numel() ** -0.5)
                else:
                    value.fill_(1.0 if name == "weight" else 0.0)
                module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)


def published_transformer(name: str) -> dict:
    """Family `name`'s published transformer config: `PUBLISHED_TRANSFORMER` in
    assets/make_tiny_<name>.py, beside the tiny pipeline it builds (the source is named there).

    Raises:
        ValueError: no such script, or it defines no `PUBLISHED_TRANSFORMER`.
    """
    import importlib
    import importlib.util

    if str(ROOT / "assets") not in sys.path:
        sys.path.insert(0, str(ROOT / "assets"))  # the scripts import each other as siblings
    module = f"make_tiny_{name.replace('-', '_')}"
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{name}: no assets/{module}.py")
    published = getattr(importlib.import_module(module), "PUBLISHED_TRANSFORMER", None)
    if published is None:
        raise ValueError(f"{name}: assets/{module}.py defines no PUBLISHED_TRANSFORMER")
    return dict(published)


def family_pipeline(name: str, device: str, layers: int | None = None, heads: int | None = None):
    """assets/tiny-`name`/ with a transformer of the family's published shapes (random bf16 weights).

    The transformer's config is `published_transformer(name)`. The VAE is rebuilt with the latent
    channels that transformer reads (its `in_channels` over the tiny pair's ratio: 4 for 2x2-packed
    FLUX latents); the text encoders' outputs are widened by a forward pre-hook on the transformer
    (the family row's `text_widths`). `layers` and `heads` cut the block stacks and the attention
    heads (the width: heads x head dim) for a smoke run on a CPU; the row names their config fields.

    Raises:
        ValueError: no such tiny pipeline, or its script has no `PUBLISHED_TRANSFORMER`.
    """
    from accelerate import init_empty_weights
    from diffusers import DiffusionPipeline

    folder = ROOT / "assets" / f"tiny-{name}"
    if not (folder / "model_index.json").is_file():
        found = sorted(p.name.removeprefix("tiny-") for p in (ROOT / "assets").glob("tiny-*/model_index.json"))
        raise ValueError(f"--family {name}: no assets/tiny-{name}/; families here: {', '.join(found)}")
    config = published_transformer(name)
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    row = family(type(pipe).__name__)
    if layers is not None:
        config.update(dict.fromkeys(row.layer_fields, layers))
    if heads is not None:
        if row.width_field:  # the same head dim at fewer heads
            config[row.width_field] = config[row.width_field] // config[row.head_fields[0]] * heads
        config.update(dict.fromkeys(row.head_fields, heads))
    tiny_channels, vae_config = pipe.transformer.config.in_channels, dict(pipe.vae.config)
    per_latent = tiny_channels // latent_channels(vae_config)
    with init_empty_weights(include_buffers=False):
        transformer = type(pipe.transformer).from_config(config).to(torch.bfloat16)
        vae_config = with_latent_channels(vae_config, config["in_channels"] // per_latent)
        vae = type(pipe.vae).from_config(vae_config).to(torch.bfloat16)
    fill_random_([transformer, vae], device)
    # A new pipeline object: its constructor derives attributes from the VAE (Qwen-Image-Edit's latent_channels).
    pipe = type(pipe)(**{**pipe.components, "transformer": transformer.eval(), "vae": vae.eval()})
    widths = {key: config[field] for key, field in row.text_widths.items()}
    transformer.register_forward_pre_hook(_widen_text(widths, device), with_kwargs=True)
    return pipe.to(device)


def _widen_text(widths: dict[str, int], device: str):
    """A forward pre-hook replacing text-embedding inputs narrower than `widths` by seeded random
    values of the right width, one fixed tensor per shape (the same in every process)."""
    cache: dict[tuple, torch.Tensor] = {}

    def widen(tensor: torch.Tensor, width: int) -> torch.Tensor:
        key = (*tensor.shape[:-1], width)
        if key not in cache:
            generator = torch.Generator(device).manual_seed(sum(key))
            cache[key] = torch.randn(key, generator=generator, device=device).to(tensor.dtype)
        return cache[key]

    def hook(module, args, kwargs):
        kwargs, args = dict(forward_signature(module).bind(*args, **kwargs).arguments), ()  # Z-Image: by position
        for name, width in widths.items():
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.shape[-1] != width:
                kwargs[name] = widen(value, width)
            elif isinstance(value, list) and value and value[0].shape[-1] != width:
                kwargs[name] = [widen(v, width) for v in value]
        return args, kwargs

    return hook


# --reference: calls of a family whose input image is optional (FLUX.2) pass one, of the output size.
REFERENCE = False


def pipe_call(pipe, size: int, steps: int | None) -> dict:
    """The keyword arguments of the app's call at size x size (families.py): an input image for edit
    families; `steps` None: the family's `min_steps`."""
    row = family(type(pipe).__name__)
    return row.capture_call(pipe, PROMPTS[0], size, size, steps, reference=REFERENCE)


def step_inputs(pipe, size: int) -> dict:
    """The transformer's real inputs for its first denoising step at size x size, from a call of the
    family's `min_steps` (Qwen-Image's scheduler gives a NaN timestep in a call of one step: its
    step's output is NaN, and a CUDA graph's check replay cannot match it)."""
    with capture({"transformer": pipe.transformer}) as calls:
        pipe(**pipe_call(pipe, size, None), output_type="latent")
    return calls["transformer"][1]


def elapsed_ms(fn) -> float:
    """Milliseconds of one `fn()` from a synchronized start: CUDA events on a GPU, a synchronized host
    clock elsewhere."""
    sync()
    if not torch.cuda.is_available():
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def median_ms(fn, warmup: int = 3, repeat: int = 15) -> float:
    """Median milliseconds of `fn()` (`elapsed_ms`) after `warmup` calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn) for _ in range(repeat))


def queued_ms(fn, calls: int = 8, repeat: int = 5) -> float:
    """Milliseconds a call of `fn()` when `calls` of them run back to back, as a pipeline calls its
    steps: the host queues the next call while the GPU runs this one, so host work that fits under
    the GPU's time is hidden (`median_ms` synchronizes around every call and shows it). The median
    over `repeat` runs of `calls` calls (`elapsed_ms`), after one such run to warm up."""

    def run() -> None:
        for _ in range(calls):
            fn()

    run()
    return statistics.median(elapsed_ms(run) / calls for _ in range(repeat))


# Kernel names by what they compute, checked in this order (the names CUDA's profiler gives on the
# H200: FA3 `flash::FlashAttnFwdSm90`, cuDNN's SDPA `cudnn_generated_fort_native_sdpa_sm90_flash_fprop`,
# cuBLAS `nvjet_*` / `sm90_xmma_gemm_*`, CUTLASS `cutlass::device_kernel`, Inductor's Triton
# templates `triton_tem_*`); everything else is "other": copies, and Inductor's pointwise and
# reduction kernels, whatever ops their names list (a RoPE and copy feeding FA3 is named
# `block_<hex>_triton_red_fused__flash_attn_forward__to_copy_add_...`: the package's name first,
# lowering.compile_package).
FUSED = re.compile(r"(^|_)triton_(poi|red|per|unk)_")  # unk: no kind in its source, as a fixed launch
KERNEL_KINDS = {
    "attention": ("flash", "fmha", "sdpa", "attention"),
    "gemm": ("gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_tem", "matmul"),
}


def kernel_kind(name: str) -> str:
    """The kind, "attention", "gemm" or "other", of a GPU kernel's name (KERNEL_KINDS, case-insensitive)."""
    lower = name.lower()
    if FUSED.search(lower):
        return "other"
    return next((kind for kind, marks in KERNEL_KINDS.items() if any(m in lower for m in marks)), "other")


def device_events(fn) -> list[tuple[str, float, float]] | None:
    """One steady call of `fn()` (after a warm-up call) under torch.profiler: its GPU operations
    (kernels, memsets, copies) as (name, start us, end us), in start order; None without CUDA. In a
    CUDA graph's replay the profiler sees each of the graph's operations."""
    if not torch.cuda.is_available():
        return None
    fn()  # warm: the profile holds one steady call
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        sync()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in events), key=lambda e: e[1])


def kernel_ms(fn, top: int) -> tuple[dict[str, float], dict[str, list[str]]] | None:
    """GPU time of one call of `fn()` by `kernel_kind` (ms, from `device_events`), and each kind's
    `top` longest kernels ("name ms", each name's calls summed, the name cut at 200 characters); None
    without CUDA."""
    events = device_events(fn)
    if events is None:
        return None
    totals = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    longest: dict[str, dict[str, float]] = {kind: {} for kind in totals}
    for name, start, end in events:
        kind, ms = kernel_kind(name), (end - start) / 1e3
        totals[kind] += ms
        longest[kind][name] = longest[kind].get(name, 0.0) + ms
    named = {
        kind: [f"{name[:200]} {ms:.2f}" for name, ms in sorted(names.items(), key=lambda kv: -kv[1])[:top]]
        for kind, names in longest.items()
    }
    return totals, named


def timeline(events: list[tuple[str, float, float]]) -> dict[str, float | int]:
    """Where the GPU's time goes in a series of GPU operations (name, start us, end us; in start
    order, as `device_events` gives them), in ms: `span_ms` from the first start to the last end,
    `busy_ms` their durations, `between_ms` the rest, and `memsets` (a count) with `memset_ms`, the
    memsets' durations and the gaps on both sides of each. cuBLASLt launches a 4-byte memset before
    some of its GEMMs, and a CUDA graph leaves 3.5 us after it against 0.4 us between two kernels
    (H200, BENCHMARKS.md section (e)). Raises `ValueError` for no events."""
    if not events:
        raise ValueError("timeline: no GPU operations were recorded")
    busy = sum(end - start for _, start, end in events)
    span = events[-1][2] - events[0][1]
    memsets, memset_us = 0, 0.0
    for i, (name, start, end) in enumerate(events):
        if "memset" not in name.lower():
            continue
        memsets += 1
        before = start - events[i - 1][2] if i else 0.0
        after = events[i + 1][1] - end if i + 1 < len(events) else 0.0
        memset_us += max(before, 0.0) + (end - start) + max(after, 0.0)
    return {
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "between_ms": (span - busy) / 1e3,
        "memsets": memsets,
        "memset_ms": memset_us / 1e3,
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def generate(pipe, size: int, steps: int) -> tuple[float, torch.Tensor]:
    """Seconds for one generation (synchronized) and its final latents."""
    final = {}

    def keep_latents(pipe, i, t, kwargs):
        final["latents"] = kwargs["latents"]
        return {}

    sync()
    start = time.perf_counter()
    pipe(
        **pipe_call(pipe, size, steps),
        generator=torch.Generator(pipe.device).manual_seed(0),
        callback_on_step_end=keep_latents,
    )
    sync()
    return time.perf_counter() - start, final["latents"].float().cpu()


def block_ms(pipe, size: int) -> dict[str, float]:
    """Median ms of the first block of each repeated class on its real inputs at size x size."""
    firsts = {name: blocks[0] for name, blocks in repeated_blocks(pipe.transformer).items()}
    (calls,) = capture_blocks(pipe, firsts, [(size, size)])
    with torch.no_grad():
        return {name: median_ms(lambda b=block, k=calls[name][1]: b(**k)) for name, block in firsts.items()}


def measure(pipe, row: dict, args, reference: torch.Tensor | None, graphs: bool) -> torch.Tensor:
    """Fill in step ms, block ms, s / image, peak GiB and rel. error; return the final latents.

    With `graphs` (compiled scenarios on CUDA) the transformer then runs as the template runs it by
    default: through CUDA graphs (`graph_step_`, what `apply_` applies). The step is timed both
    ways, the replay is compared with the plain step on inputs other than the captured ones, and
    the generation runs with graphs.
    """
    kwargs = step_inputs(pipe, args.size)
    step = functools.partial(pipe.transformer, **kwargs)  # the plain step; the graphed one where graphs run
    with torch.no_grad():
        row["step_ms"] = median_ms(step)
        try:  # the breakdown explains the step; a profiler that fails must not lose the step's numbers
            kernels = kernel_ms(step, args.top)
        except Exception as exc:
            kernels, row["kernels_error"] = None, f"{type(exc).__name__}: {exc}"
    if kernels:
        row["kernels_ms"], row["top_kernels"] = kernels
    if variant(row["scenario"])[0] not in PEERS:  # forward hooks: they need plain steps, not torch.compile's regions
        row["block_ms"] = block_ms(pipe, args.size)
    if graphs:
        graphed = graph_step_(pipe.transformer)
        with torch.no_grad():
            graphed(**kwargs)  # capture, then the replay check
            if graphed.graphs and not graphed.failed:
                changed = [n for n in ("hidden_states", "encoder_hidden_states", "timestep") if n in kwargs]
                other = {**kwargs, **{n: torch.randn_like(kwargs[n]) for n in changed}}
                row["graph_rel_error"] = rel_error(graphed(**other), graphed.step(**other))
                step = functools.partial(graphed, **kwargs)
                row["step_ms_no_graphs"], row["step_ms"] = row["step_ms"], median_ms(step)
                try:  # as the kernels above: the profile explains the step and must not lose it
                    row["replay"] = timeline(device_events(step))
                except Exception as exc:
                    row["replay_error"] = f"{type(exc).__name__}: {exc}"
            else:
                row["graphs_failed"] = graphed.failed or "the step inputs were refused (graphs._key)"
                unpatch_forward(pipe.transformer, GraphedStep)
    with torch.no_grad():
        row["step_ms_queued"] = queued_ms(step)
    generate(pipe, args.size, 2)  # warm up the text encoders and VAE at this size
    reset_peak()
    row["s_per_image"], latents = generate(pipe, args.size, args.steps)
    row["peak_gib"] = peak_gib()
    row["rel_error"] = None if reference is None else rel_error(latents, reference)
    return latents


def build(args, load: str | None = None):
    """The pipeline to measure, loaded as `load_pipeline` loads it: with the CPU ISA probe a compile
    for a CPU needs running beside, unless packages are to be loaded from `load` (a warm start)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    probe = not load and portability.needs_probe(torch.device(device))
    if args.family:
        if probe:
            portability.probe_in_background()
        return family_pipeline(args.family, device, args.layers, args.heads)
    if args.model == RANDOM:
        if probe:
            portability.probe_in_background()
        return random_flux_dev(device)
    return load_pipeline(Options.from_env(environ={**os.environ, "MODEL_ID": args.model, "AOT_LOAD": load or ""}))


def compile_like_diffusers(pipe, granularity: str, size: int) -> float:
    """Make `pipe` fast as a diffusers user would without this template (diffusers' docs on regional
    compilation, torchao and attention backends): torchao's FP8 on every linear layer of the
    transformer (dynamic activations, `granularity` "row" or "tensor", torchao's default fast
    accumulation), FlashAttention-3 through diffusers' dispatcher (`_flash_3`, loaded as the
    template loads it: `AOT_FA3_KERNEL`), then `compile_repeated_blocks(fullgraph=True)`.

    Returns its ready time: seconds from the quantization to the end of the first step at
    size x size, where torch.compile compiles (no CUDA graphs: torch.compile's default mode).
    """
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    start = time.perf_counter()
    scale = PerRow() if granularity == "row" else PerTensor()
    quantize_(pipe.transformer, Float8DynamicActivationFloat8WeightConfig(granularity=scale))
    load_fa3(Options.from_env().fa3_kernel)
    pipe.transformer.set_attention_backend("_flash_3")
    pipe.transformer.compile_repeated_blocks(fullgraph=True)
    with torch.no_grad():
        pipe.transformer(**step_inputs(pipe, size))
    sync()
    return time.perf_counter() - start


def start_space(pipe, options: Options) -> Report:
    """`pipe` compiled (or loaded), saved and applied as `python app.py` does it (app.py's `start`:
    compile.py's `compile_transformer`, then `save_and_push` where `options.save` is set, then
    `apply_`); returns the report."""
    import app

    return app.start(options, pipe).reports[0]


def worker(names: list[str], args) -> None:
    """Run `names` in this process; print one `ROW {json}` line per scenario. The log goes to stderr
    (run_group's log file), as `python app.py` logs: the zerogpu rows read their workers' lines."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if names == ["warm"]:
        return print("ROW " + json.dumps(warm_start(args)), flush=True)
    if names == ["lora"]:
        return print("ROW " + json.dumps(lora_switching(args)), flush=True)
    if names[0] in ZEROGPU:
        print("ROW " + json.dumps(zerogpu_start(args, names[0])), flush=True)
        os._exit(0)  # a Space never stops, and closing it hung here on the H200; its worker is ended
    pipe = build(args)
    work = Path(args.work)
    reference = torch.load(work / "eager.pt") if (work / "eager.pt").exists() else None
    compiles = 0
    for name in names:
        row = {"scenario": name, "ready_s": None, "cold": None, "decisions": []}
        scenario = variant(name)[0]  # its settings are this process's environment (run_group)
        try:
            if scenario in PEERS:
                row["ready_s"], row["cold"] = compile_like_diffusers(pipe, PEERS[scenario], args.size), True
            elif SCENARIOS[scenario] is not None:
                for block in pipe.transformer.modules():  # back to eager blocks, same weights
                    unpatch_forward(block)
                # graphs are applied in `measure`, after the per-block timing (which needs plain steps)
                options = dataclasses.replace(Options.from_env(), cuda_graphs="off", **SCENARIOS[scenario])
                if name == "all":  # warm loads them; a variant's packages are not saved
                    options = dataclasses.replace(options, save=str(work / "packages"))
                if portability.needs_probe(pipe.transformer.device):
                    start = time.perf_counter()
                    portability.probe_in_background().join()  # once per process; a Space overlaps it with the weights
                    row["isa_probe_s"] = time.perf_counter() - start
                start = time.perf_counter()
                report = start_space(pipe, options)
                row["ready_s"], row["cold"] = time.perf_counter() - start, compiles == 0
                compiles += 1
                row["decisions"] = [str(d) for d in report.decisions]
                row["blocks"] = {
                    p.block: {"rel_error": p.rel_error, "fp8": p.fp8, "export_s": p.export_s, "compile_s": p.compile_s}
                    for p, _ in report.rows
                }
            graphs = SCENARIOS.get(scenario) is not None and torch.cuda.is_available()
            latents = measure(pipe, row, args, reference, graphs)
            if name == "eager":  # the reference; a variant of eager is compared with it
                torch.save(latents, work / "eager.pt")
                reference = latents
        except Exception as exc:  # one failing scenario must not hide the others' numbers
            row["error"] = f"{type(exc).__name__}: {exc}"
        print("ROW " + json.dumps(row), flush=True)


def warm_start(args) -> dict:
    """app.py as a Space starts it with saved packages (AOT_LOAD), then app.run on real prompts.

    load_s: `app.start` once its libraries are imported: load and verify the packages, apply them
    to the blocks, build the UI. first_step_s: the first step at the bench size, which binds every
    block to its package (and captures the step's CUDA graph). ready_s: both. Loading the weights
    is not part of it; neither is the CPU ISA probe, which a warm start does not run (isa_probes).
    """
    import gradio  # noqa: F401  (library imports are not part of the warm start)
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    import app

    packages = str(Path(args.work) / "packages")
    pipe = build(args, load=packages)
    os.environ.update(AOT_LOAD=packages, AOT_STRICT="1")
    row = {"scenario": "warm", "cold": None}
    start = time.perf_counter()
    server = app.start(Options.from_env(), pipe)
    app.ui(server)
    row["load_s"] = time.perf_counter() - start
    first = time.perf_counter()
    pipe(PROMPTS[0], height=args.size, width=args.size, num_inference_steps=1, output_type="latent")
    sync()
    row["first_step_s"] = time.perf_counter() - first
    row["ready_s"] = time.perf_counter() - start
    row["isa_probes"] = valid_vec_isa_list.cache_info().misses
    row["decisions"] = [server.status]
    kwargs = step_inputs(pipe, args.size)
    with torch.no_grad():
        row["step_ms"] = median_ms(lambda: pipe.transformer(**kwargs))
    app.run((PROMPTS[1], 1, False, args.size, args.size, 2, 3.5), -1)  # warm up text encoders and VAE
    reset_peak()
    times = []
    for seed, prompt in enumerate(PROMPTS):
        start = time.perf_counter()
        path, _, _ = app.run((prompt, seed, False, args.size, args.size, args.steps, 3.5), -1)
        sync()
        times.append(time.perf_counter() - start)
    row["s_per_image"] = statistics.median(times)
    row["peak_gib"] = peak_gib()
    row["image_size"] = list(Image.open(path).size)
    return row


def random_lora(pipe, path: Path) -> int:
    """Write a seeded rank-`LORA_RANK` LoRA to `path` for the linear layers in `pipe`'s repeated blocks
    that its family row's `lora_targets` name (diffusers' keys, no alpha: scaling 1); returns the
    number of layers. Its product is about a sixth of a random weight's size: A ~ N(0, 1/in) and
    B ~ N(0, 0.01/r) give entries of std 0.1/sqrt(in), against 0.58/sqrt(in) for a weight drawn
    uniformly from +-1/sqrt(in)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(1)
    transformer, targets = pipe.transformer, family(type(pipe).__name__).lora_targets
    blocks = {id(b) for found in repeated_blocks(transformer).values() for b in found}
    tensors = {}
    for where, block in transformer.named_modules():
        if id(block) not in blocks:
            continue
        for sub, layer in block.named_modules():
            if isinstance(layer, torch.nn.Linear) and sub.startswith(targets):
                a = torch.randn(LORA_RANK, layer.in_features, generator=generator) / layer.in_features**0.5
                b = torch.randn(layer.out_features, LORA_RANK, generator=generator) * (0.01 / LORA_RANK) ** 0.5
                tensors[f"transformer.{where}.{sub}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"transformer.{where}.{sub}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, path)
    return len(tensors) // 2


def lora_switching(args) -> dict:
    """A rank-16 LoRA switched per request on the template's default path (every fast path auto,
    CUDA graphs): its latents against eager + the same LoRA through peft, the step with and without
    it, and the seconds `lora.Adapters.use` takes (the first switch copies the base)."""
    from aot import lora, lora_specs

    work = Path(args.work)
    pipe = build(args)
    source = work / "random-lora.safetensors"
    row = {"scenario": "lora", "cold": True, "lora_layers": random_lora(pipe, source)}
    pipe.load_lora_weights(str(source), adapter_name="random")
    _, reference = generate(pipe, args.size, args.steps)  # eager + peft's LoRA layers
    pipe.unload_lora_weights()  # plain layers again, base weights untouched (nothing was fused)
    if portability.needs_probe(pipe.transformer.device):
        portability.probe_in_background().join()
    start = time.perf_counter()
    report = start_space(pipe, Options.from_env())
    row["ready_s"] = time.perf_counter() - start
    row["decisions"] = [str(d) for d in report.decisions]
    fp8 = report.compiled.fp8_config
    adapters = lora.Adapters(pipe, [lora_specs.LoraSpec("random", str(source))], fp8)
    kwargs = step_inputs(pipe, args.size)  # the first step at this size captures its CUDA graph
    with torch.no_grad():
        row["base_step_ms"] = median_ms(lambda: pipe.transformer(**kwargs))
        row["switch_first_s"] = adapters.use("random")
        row["step_ms"] = median_ms(lambda: pipe.transformer(**kwargs))
        row["switch_off_s"] = adapters.use(None)
        row["switch_on_s"] = adapters.use("random")
    row["base_copy_gb"] = adapters.base_bytes / 1e9
    generate(pipe, args.size, 2)
    reset_peak()
    row["s_per_image"], latents = generate(pipe, args.size, args.steps)
    row["peak_gib"] = peak_gib()
    row["rel_error"] = rel_error(latents, reference)
    return row


def zerogpu_start(args, name: str) -> dict:
    """app.py as a ZeroGPU Space runs it, compiled (`zerogpu`) or eager (`zerogpu-eager`,
    AOT_COMPILE=0, which run_group sets); this process is the Space's main process, under
    zerogpu_harness.py (run_group starts it so): CUDA is emulated here, GPU work runs in workers.

    ready_s: `app.start` and `app.ui` (the startup call compiles in a worker and returns
    the packages, FP8 quantizes the blocks here, the UI is built). launch_s: `demo.launch`, which
    packs the weights to disk. new_worker_s: /generate on a new worker (the harness reclaims the
    worker before each, then the GPU is let go idle: `wait_for_idle_gpu`, idle_wait_s the median
    wait), median of `NEW_WORKERS`, and of it, in this process: generate_s
    (`app.run`: the request's checks and the GPU call) and infer_s (`app.infer`, the GPU call: asking for
    a GPU, the worker's start and call, the result's way back); s_per_image: warm requests (the worker reused);
    step_ms: (warm request - request of 2 steps) / (steps - 2). moved_gb: the weights a new worker
    moves (`server.weight_bytes`). The worker's own breakdown comes from its `zerogpu-call` log
    lines (`zerogpu.worker`), medians over new workers: wait_s (asking for the GPU to the call: spaces
    moving the weights), the AoT-only costs (package loads, binds, CUDA graph captures and check
    replays), and
    other_first_s (the first call minus a warm call minus those: first calls of the text encoders,
    the VAE, kernels); imports: the modules the first call imported (none, where the main process
    imported everything before the fork). Peak GPU memory belongs to the worker and is not measured here.
    """
    import spaces  # noqa: F401  (ZeroGPU mode: patches torch before anything else touches it)
    from gradio_client import Client

    from aot.server import weight_bytes

    calls = Path(args.work) / f"{name}-calls.log"  # workers fork after this: they inherit the handler
    handler = logging.FileHandler(calls)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("zerogpu").addHandler(handler)
    row = {"scenario": name, "cold": True}
    if args.model == RANDOM:
        pipe = random_flux_dev_on_cpu().to("cuda")  # emulated CUDA tensors: the weights stay in this process
    else:
        env = {**os.environ, "MODEL_ID": args.model, "AOT_COMPILE": str(int(name == "zerogpu"))}
        pipe = load_pipeline(Options.from_env(environ=env))
    start = time.perf_counter()
    import app

    server = app.start(Options.from_env(), pipe)
    # this process's part of a request: app.run (what /generate runs in its thread) and its GPU call
    served = {"generate": timed(app, "run"), "infer": timed(app, "infer")}
    demo = app.ui(server)
    row["ready_s"] = time.perf_counter() - start
    row["decisions"] = [server.status]
    row["moved_gb"] = weight_bytes(pipe) / 1e9
    port = int(os.environ["GRADIO_SERVER_PORT"])
    start = time.perf_counter()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True)
    row["launch_s"] = time.perf_counter() - start
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    reclaim = urllib.request.Request(os.environ["SPACES_ZERO_DEVICE_API_URL"] + "/reclaim", method="POST")

    on_new: list[bool] = []  # per request, in order: whether it ran on a new worker
    idle_waits: list[float] = []  # per new worker: seconds from the kill until the GPU was idle

    def request(steps: int, new_worker: bool = False) -> float:
        on_new.append(new_worker)
        if new_worker:
            urllib.request.urlopen(reclaim, timeout=30).close()  # the harness kills the GPU worker
            idle_waits.append(wait_for_idle_gpu())
        begin = time.perf_counter()
        client.predict(PROMPTS[0], 0, False, args.size, args.size, steps, 3.5, api_name="/generate")
        return time.perf_counter() - begin

    new = [request(args.steps, new_worker=True)]
    row["s_per_image"] = statistics.median(request(args.steps) for _ in range(2))
    short = statistics.median(request(2) for _ in range(2))
    row["step_ms"] = (row["s_per_image"] - short) / (args.steps - 2) * 1e3
    new += [request(args.steps, new_worker=True) for _ in range(NEW_WORKERS - 1)]
    row["new_worker_s"] = statistics.median(new)
    row["idle_wait_s"] = statistics.median(idle_waits)
    for part, seconds in served.items():  # where a new worker's request spends its time in this process
        row[f"new_{part}_s"] = statistics.median(t for t, fresh in zip(seconds, on_new, strict=True) if fresh)
    urllib.request.urlopen(reclaim, timeout=30).close()
    lines = [json.loads(line.split(" ", 1)[1]) for line in calls.read_text().splitlines() if "zerogpu-call" in line]
    infer = [line for line in lines if line["fn"] == "infer"]
    firsts = [line for line in infer if line["new_worker"]]
    warm = statistics.median(line["call_s"] for line in infer if line["call"] in (2, 3))  # the full warm requests
    keys = ("wait_s", "call_s", "loads", "load_s", "binds", "bind_s", "captures", "capture_s", "checks", "check_s")
    for key in keys:
        row[f"new_{key}"] = statistics.median(line[key] for line in firsts)
    row["new_imports"] = statistics.median(line["imported"] for line in firsts)
    row["new_aot_s"] = row["new_load_s"] + row["new_bind_s"] + row["new_capture_s"] + row["new_check_s"]
    row["new_other_first_s"] = row["new_call_s"] - warm - row["new_aot_s"]
    row["warm_call_s"] = warm
    return row


def wait_for_idle_gpu(limit_s: float = 20.0) -> float:
    """Wait until the harness's GPU (`ZEROGPU_HARNESS_GPU`, default 0) holds less than `IDLE_MIB`,
    as after a quiet spell; returns the seconds waited (0 without `nvidia-smi`: a CPU run).

    A killed worker's GPU context is torn down after the kill returns; a worker started meanwhile
    shares the GPU with that teardown, and new workers started so were slower than one started on an
    idle GPU. A visitor after a quiet spell meets an idle GPU. After `limit_s` it goes on anyway."""
    query = ["nvidia-smi", "--id=" + os.environ.get("ZEROGPU_HARNESS_GPU", "0")]
    query += ["--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        try:
            used = float(subprocess.run(query, capture_output=True, text=True, check=True).stdout.split()[0])
        except (OSError, subprocess.CalledProcessError, IndexError, ValueError):
            return 0.0
        if used < IDLE_MIB:
            break
        time.sleep(0.1)
    return time.perf_counter() - start


# GPU memory in use (MiB, nvidia-smi) below which no worker holds weights: a driver holds a few hundred.
IDLE_MIB = 1024

# New workers measured per zerogpu row (the first request, and after each reclaim): the disk a new
# worker reads its weights from varies by seconds between workers (BENCHMARKS.md).
NEW_WORKERS = 5


def timed(obj: object, name: str) -> list[float]:
    """Wrap the function `obj.name` (an instance's method or a module's function; its signature kept,
    which gradio reads) to append each call's seconds to the list returned."""
    method, seconds = getattr(obj, name), []

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(obj, name, wrapper)
    return seconds


def environment() -> dict:
    import diffusers
    import torchao

    # `-dirty`: the tree differs from that commit (the measured code is not the commit alone)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT)
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "torchao": torchao.__version__,
        "commit": commit.stdout.strip() or "unknown",
    }


def group_label(names: list[str]) -> str:
    """The group's name in file names (its log, its compile caches): its first scenario, with what a
    variant's values may hold that a file name cannot (a path's "/") as "_"."""
    return re.sub(r"[^\w.+=@-]", "_", names[0])


def group_env(names: list[str], work: str) -> dict[str, str]:
    """The environment of the process that runs the group `names`: this one's, with empty compile
    caches of its own under `work`, the engine importable, and the settings of its variant
    (`variant`; a variant runs in a group of its own) over all of them."""
    caches = Path(work) / "caches" / group_label(names)
    return {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),  # the engine, aot/
        **variant(names[0])[1],
    }


def run_group(names: list[str], args, logs: Path) -> list[dict]:
    """One group in a fresh process (`group_env`); its log and rows (rows.jsonl) go to `logs`."""
    env = group_env(names, args.work)
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--worker", ",".join(names), *_shared_flags(args)]
    if names[0] in ZEROGPU:  # the Space's main process in ZeroGPU mode, the device API beside it
        env["GRADIO_SERVER_PORT"] = str(_free_port())
        env["AOT_COMPILE"] = str(int(names[0] == "zerogpu"))
        harness = [str(ROOT / "tools" / "zerogpu_harness.py"), "--port", str(_free_port())]
        if not torch.cuda.is_available():
            harness.append("--cpu")  # a smoke run on a machine without a GPU
        cmd = [sys.executable, *harness, *cmd[1:]]
    log_path = logs / f"{group_label(names)}.log"
    with open(log_path, "w") as log:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
    rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode != 0 or len(rows) != len(names):
        tail = log_path.read_text()[-2000:]
        rows += [{"scenario": n, "error": f"worker exited {done.returncode}: {tail}"} for n in names[len(rows) :]]
    with open(logs / "rows.jsonl", "a") as saved:  # kept if a later group dies
        for row in rows:
            print(f"{row['scenario']}: {row.get('error') or 'done'}", file=sys.stderr, flush=True)
            saved.write(json.dumps(row) + "\n")
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shared_flags(args) -> list[str]:
    flags = ["--model", args.model, "--size", str(args.size), "--steps", str(args.steps), "--work", args.work]
    flags += ["--family", args.family] if args.family else []
    flags += ["--layers", str(args.layers)] if args.layers is not None else []
    flags += ["--reference"] if args.reference else []
    flags += ["--top", str(args.top)]
    return flags + (["--heads", str(args.heads)] if args.heads is not None else [])


def table(rows: list[dict], args) -> str:
    eager = next(r for r in rows if r["scenario"] == "eager" and "error" not in r)
    lines = [
        f"{args.family or args.model}: {args.size}x{args.size}, {args.steps} steps, batch 1"
        + (f", {args.layers} layer(s) per stack" if args.layers is not None else "")
        + (f", {args.heads} head(s)" if args.heads is not None else "")
        + (", with a reference image" if args.reference else ""),
        "| scenario | step ms | speedup | steps queued | without CUDA graphs | s / image | ready s | ISA probe s "
        "| peak GiB | rel. error vs eager |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['scenario']} | failed: {row['error'][:200]} |||||||||")
            continue
        row["speedup"] = eager["step_ms"] / row["step_ms"]
        plain = row.get("step_ms_no_graphs")
        if row.get("graphs_failed"):
            plain = f"graphs failed: {row['graphs_failed'][:80]}"
        elif plain is not None:
            plain = f"{plain:.1f} ({eager['step_ms'] / plain:.2f}x; replay error {row['graph_rel_error']:.0e})"
        queued = "-"
        if row.get("step_ms_queued") and eager.get("step_ms_queued"):
            queued = f"{row['step_ms_queued']:.1f} ({eager['step_ms_queued'] / row['step_ms_queued']:.2f}x)"
        ready = "-" if row["ready_s"] is None else f"{row['ready_s']:.1f}{'' if row['cold'] in (True, None) else '*'}"
        probe = "-" if row.get("isa_probe_s") is None else f"{row['isa_probe_s']:.1f}"
        peak = "-" if row.get("peak_gib") is None else f"{row['peak_gib']:.1f}"
        error = "-" if row.get("rel_error") is None else f"{row['rel_error']:.1e}"
        lines.append(
            f"| {row['scenario']} | {row['step_ms']:.1f} | {row['speedup']:.2f}x | {queued} | {plain or '-'} "
            f"| {row['s_per_image']:.2f} | {ready} | {probe} | {peak} | {error} |"
        )
        if row.get("kernels_ms"):
            ms = row["kernels_ms"]
            notes.append(
                f"{row['scenario']} kernels of one plain step: attention {ms['attention']:.1f} ms, GEMM "
                f"{ms['gemm']:.1f} ms, other {ms['other']:.1f} ms ({sum(ms.values()):.1f} ms of its "
                f"{row.get('step_ms_no_graphs', row['step_ms']):.1f} ms)"
            )
        if row.get("replay"):
            replay = row["replay"]
            notes.append(
                f"{row['scenario']} graphed step under the profiler: GPU busy {replay['busy_ms']:.1f} ms, "
                f"{replay['between_ms']:.1f} ms between its operations ({replay['memset_ms']:.1f} ms at "
                f"{replay['memsets']} memsets)"
            )
        for block, meta in row.get("blocks", {}).items():
            notes.append(
                f"{row['scenario']} {block}: export {meta['export_s']:.1f} s, compile {meta['compile_s']:.1f} s, "
                f"rel. error {meta['rel_error']:.1e}{' (FP8)' if meta['fp8'] else ''}"
            )
        if row["scenario"] == "lora":
            notes.append(
                f"lora: rank {LORA_RANK} on {row['lora_layers']} layers; switch from none "
                f"{row['switch_first_s']:.3f} s the first time (copies the base, {row['base_copy_gb']:.1f} GB), "
                f"then on {row['switch_on_s']:.3f} s, off {row['switch_off_s']:.3f} s; step {row['step_ms']:.1f} ms "
                f"with it, {row['base_step_ms']:.1f} ms without; rel. error is vs eager + the same LoRA through peft"
            )
        if row["scenario"] == "warm":
            notes.append(
                f"warm: load + verify + apply {row['load_s']:.2f} s, first step (binds every block) "
                f"{row['first_step_s']:.2f} s, CPU ISA probes run: {row['isa_probes']}"
            )
    return "\n".join(lines + [""] + notes + zerogpu_table(rows))


def zerogpu_table(rows: list[dict]) -> list[str]:
    """The ZeroGPU rows side by side: what a visitor waits for on a new worker and on a warm one."""
    done = {row["scenario"]: row for row in rows if row["scenario"] in ZEROGPU and "error" not in row}
    if not done:
        return []
    lines = [
        "",
        "| ZeroGPU mode | new worker s | of it: generate s, GPU call s | warm s | step ms | GB moved | new worker: "
        "wait s (weights) | package loads, s | binds, s | graph captures, s | check replays, s | other first calls s "
        "| modules imported |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in done.items():
        lines.append(
            f"| {name} | {row['new_worker_s']:.2f} | {row['new_generate_s']:.2f}, {row['new_infer_s']:.2f} "
            f"| {row['s_per_image']:.2f} | {row['step_ms']:.1f} | {row['moved_gb']:.1f} | {row['new_wait_s']:.2f} "
            f"| {row['new_loads']:.0f}, {row['new_load_s']:.3f} | {row['new_binds']:.0f}, {row['new_bind_s']:.3f} "
            f"| {row['new_captures']:.0f}, {row['new_capture_s']:.3f} | {row['new_checks']:.0f}, "
            f"{row['new_check_s']:.3f} | {row['new_other_first_s']:.2f} | {row['new_imports']:.0f} |"
        )
    if len(done) == 2:
        aot, eager = done["zerogpu"], done["zerogpu-eager"]
        lines.append(
            f"\nzerogpu vs zerogpu-eager: new worker {aot['new_worker_s'] / eager['new_worker_s']:.2f}x the time, "
            f"warm step {eager['step_ms'] / aot['step_ms']:.2f}x faster, {aot['moved_gb'] / eager['moved_gb']:.2f}x "
            f"the bytes; AoT-only part of a new worker {aot['new_aot_s']:.3f} s; startup {aot['ready_s']:.1f} s, "
            f"launch (packs the weights) {aot['launch_s']:.1f} s"
        )
    return lines


def work_folder(keep: str | None) -> contextlib.AbstractContextManager[str]:
    """The run's work folder as a context giving its absolute path: `keep`, made if new and left in
    place after the run, or, without one, a temporary folder deleted after it.

    Raises:
        ValueError: `keep` is a file, or a folder with something in it (a run would read another
            run's eager latents and compile from its warm caches).
    """
    if keep is None:
        return tempfile.TemporaryDirectory()
    folder = Path(keep).resolve()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{keep} is {'not empty' if folder.is_dir() else 'a file'}; give a new or empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(folder))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [n for group in GROUPS for n in group]
    parser.add_argument(
        "--scenarios",
        default=None,
        help=f"comma-separated, from: {', '.join(names)} (default: all of them; with --family all but warm, "
        "zerogpu); a variant, e.g. all@CUBLASLT_WORKSPACE_SIZE=32768@AOT_FP8=off, runs that scenario in a process of "
        "its own with those environment variables set",
    )
    parser.add_argument("--model", default=RANDOM, help="pipeline to measure (default: FLUX.1-dev shapes, random)")
    parser.add_argument(
        "--family",
        default=None,
        help="measure assets/tiny-FAMILY/ at its published transformer shapes, random weights (e.g. z-image)",
    )
    parser.add_argument("--layers", type=int, default=None, help="with --family: blocks per stack (a smoke run)")
    parser.add_argument("--heads", type=int, default=None, help="with --family: attention heads (a smoke run)")
    parser.add_argument(
        "--reference", action="store_true", help="with --family of an optional input image (FLUX.2): pass one"
    )
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--top", type=int, default=3, help="longest kernels of each kind kept in the line (default 3)")
    parser.add_argument("--logs", default=None, help="folder for each group's log (default: a temporary one)")
    parser.add_argument(
        "--results",
        default=str(ROOT / "benchmarks" / "results.jsonl"),
        help="file the JSON line is appended to ('' for none; default: benchmarks/results.jsonl)",
    )
    parser.add_argument(
        "--keep",
        default=None,
        help="a new or empty folder to keep the run's work in: each group's Inductor and Triton caches (under "
        "caches/GROUP/), the packages `all` saved, eager's latents (default: a temporary folder, deleted)",
    )
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top: {args.top} kernels; give at least 1")
    global REFERENCE
    REFERENCE = args.reference
    if args.worker:
        worker(args.worker.split(","), args)
        return 0
    family_names = [n for n in names if n not in ("warm", *ZEROGPU, *PEERS)]
    wanted = args.scenarios.split(",") if args.scenarios else family_names if args.family else names
    try:
        parsed = {spec: variant(spec) for spec in wanted}
    except ValueError as exc:
        parser.error(f"--scenarios: {exc}")
    if "eager" not in wanted or any(name not in names for name, _ in parsed.values()):
        parser.error(f"--scenarios: include eager; choose from {', '.join(names)}")
    if "warm" in wanted and "all" not in wanted:
        parser.error("--scenarios: warm starts from the packages `all` saves; add all")
    if args.family and ({"warm", *ZEROGPU} & set(wanted)):
        parser.error(
            "--family measures eager, aot, aot+fa3, aot+fp8, all, fa3 and sm120; warm and zerogpu run FLUX.1-dev"
        )
    try:
        folder = work_folder(args.keep)
    except ValueError as exc:
        parser.error(f"--keep: {exc}")
    with folder as work:
        args.work = work
        logs = Path(args.logs or work)
        logs.mkdir(parents=True, exist_ok=True)
        (logs / "rows.jsonl").unlink(missing_ok=True)  # this run's rows only
        rows = []
        for group in [*GROUPS, *([spec] for spec, (_, env) in parsed.items() if env)]:
            chosen = [n for n in group if n in wanted]
            if chosen:
                rows += run_group(chosen, args, logs)
    print(table(rows, args))
    shape = {
        "family": args.family or args.model,
        "layers": args.layers,
        "heads": args.heads,
        "reference": args.reference,
    }
    shape.update(size=args.size, steps=args.steps)
    line = json.dumps({**environment(), **shape, "rows": rows})
    print(line)
    if args.results:  # the record BENCHMARKS.md's tables name their lines in
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as results:
            results.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

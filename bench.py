"""Benchmark regional AoT against eager on one GPU, every scenario in one run.

The pipeline has FLUX.1-dev's published component configs and random weights (seeded; no download),
so the numbers are about shapes and kernels, not image quality. Per scenario, with a fresh transformer
built from the same seed:

    step ms      median of the transformer's forward at 1024x1024 (CUDA events, after warm-up)
    s / image    one 28-step generation: text encoders + 28 steps + VAE decode
    compile s    regional compile from scratch (empty Inductor cache)
    peak GiB     peak allocated GPU memory during that generation
    rel. error   ||latents - eager latents|| / ||eager latents|| after 28 steps, same seed
    speedup      eager step ms / step ms, eager measured in this run

It prints a markdown table, then one JSON line (date, GPU, versions, commit, rows) last.

    python bench.py                      # all scenarios, 1024x1024, 28 steps
    python bench.py --scenarios eager,aot
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from compile import optimize_
from options import Options

ROOT = Path(__file__).resolve().parent
# FLUX.1-dev's published configs (black-forest-labs/FLUX.1-dev, */config.json), weights random.
TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=[16, 56, 56],
)
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
# Each scenario adds one piece to the options from the environment (AOT_FA3_KERNEL, ...); `all` is
# the template's default: everything `auto`.
SCENARIOS = {
    "eager": None,
    "aot": dict(attention="sdpa", fp8="off"),
    "aot+fa3": dict(attention="fa3", fp8="off"),
    "aot+fp8": dict(attention="sdpa", fp8="on"),
    "all": dict(),
    "aot+fp8-row": dict(attention="sdpa", fp8="on", fp8_granularity="row"),
    "aot+fp8-tensor": dict(attention="sdpa", fp8="on", fp8_granularity="tensor"),
}
DEFAULT_SCENARIOS = "eager,aot,aot+fa3,aot+fp8,all"
PROMPT = "a photo of a red fox in fresh snow, morning light"


def random_transformer(device: str) -> torch.nn.Module:
    """FLUX.1-dev's transformer with seeded random bf16 weights (the same weights every call)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        return FluxTransformer2DModel(**TRANSFORMER).to(torch.bfloat16).eval()


def random_flux_dev(device: str):
    """A FluxPipeline with FLUX.1-dev's component configs and seeded random bf16 weights."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    sys.path.insert(0, str(ROOT / "assets"))
    from make_tiny_flux import SCHEDULER, clip_tokenizer, t5_tokenizer  # ids stay below the vocab sizes

    torch.manual_seed(0)
    with torch.device(device):
        text_encoder = CLIPTextModel(CLIPTextConfig(**CLIP)).to(torch.bfloat16)
        text_encoder_2 = T5EncoderModel(T5Config(**T5)).to(torch.bfloat16)
        vae = AutoencoderKL(**VAE).to(torch.bfloat16)
    return FluxPipeline(
        transformer=random_transformer(device),
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=clip_tokenizer(),
        tokenizer_2=t5_tokenizer(),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    )


def step_inputs(pipe, size: int) -> dict:
    """The transformer's real inputs for one denoising step at size x size."""
    captured = {}

    def record(module, args, kwargs):
        captured.setdefault("kwargs", kwargs)

    handle = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    pipe(PROMPT, height=size, width=size, num_inference_steps=1, output_type="latent")
    handle.remove()
    return captured["kwargs"]


def median_ms(fn, warmup: int = 3, repeat: int = 15) -> float:
    """Median milliseconds of `fn()` on the GPU, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def generate(pipe, size: int, steps: int) -> tuple[float, torch.Tensor]:
    """Seconds for one generation (synchronized) and its final latents."""
    final = {}

    def keep_latents(pipe, i, t, kwargs):
        final["latents"] = kwargs["latents"]
        return {}

    torch.cuda.synchronize()
    start = time.perf_counter()
    pipe(
        PROMPT,
        height=size,
        width=size,
        num_inference_steps=steps,
        generator=torch.Generator("cuda").manual_seed(0),
        callback_on_step_end=keep_latents,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - start, final["latents"].float()


def block_ms(pipe, size: int) -> dict[str, float]:
    """Median ms of the first block of each repeated class on its real inputs at size x size."""
    from blocks import repeated_blocks
    from compile import capture_blocks

    firsts = {name: blocks[0] for name, blocks in repeated_blocks(pipe.transformer).items()}
    (calls,) = capture_blocks(pipe, firsts, [(size, size)])
    with torch.no_grad():
        return {name: median_ms(lambda b=block, k=calls[name][1]: b(**k)) for name, block in firsts.items()}


def run(pipe, name: str, options: Options | None, size: int, steps: int, reference: torch.Tensor | None):
    """One scenario on a fresh transformer (same seed, so the same weights as eager).

    Returns the row and the final latents."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    pipe.transformer = None
    gc.collect()
    torch.cuda.empty_cache()
    pipe.transformer = random_transformer("cuda")
    row = {"scenario": name, "compile_s": None, "decisions": []}
    if options is not None:
        with tempfile.TemporaryDirectory() as cache, temporary_cache_dir(cache):
            start = time.perf_counter()
            report = optimize_(pipe, options)
            row["compile_s"] = time.perf_counter() - start
        row["decisions"] = [str(d) for d in report.decisions]
        row["blocks"] = {p.block: {"rel_error": p.rel_error, "fp8": p.fp8} for p, _ in report.rows}
        print(report, flush=True)
    kwargs = step_inputs(pipe, size)
    with torch.no_grad():
        row["step_ms"] = median_ms(lambda: pipe.transformer(**kwargs))
    row["block_ms"] = block_ms(pipe, size)
    generate(pipe, size, 2)  # warm up the text encoders and VAE at this size
    torch.cuda.reset_peak_memory_stats()
    row["s_per_image"], latents = generate(pipe, size, steps)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["rel_error"] = 0.0 if reference is None else ((latents - reference).norm() / reference.norm()).item()
    print(json.dumps(row), flush=True)
    return row, latents


def environment() -> dict:
    import diffusers
    import torchao

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "torchao": torchao.__version__,
        "commit": commit.stdout.strip() or "unknown",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--scenarios", default=DEFAULT_SCENARIOS, help=f"comma-separated, eager first, from: {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=28)
    args = parser.parse_args(argv)
    names = args.scenarios.split(",")
    if names[0] != "eager" or any(n not in SCENARIOS for n in names):
        parser.error(f"--scenarios: start with eager, then any of {', '.join(SCENARIOS)}")
    if not torch.cuda.is_available():
        parser.error("bench.py measures GPU speed and needs CUDA")

    pipe = random_flux_dev("cuda")
    rows, reference = [], None
    for name in names:
        try:
            changes = SCENARIOS[name]
            options = None if changes is None else dataclasses.replace(Options.from_env(), **changes)
            row, latents = run(pipe, name, options, args.size, args.steps, reference)
        except Exception as exc:  # one failing scenario must not hide the others' numbers
            print(f"{name}: failed: {type(exc).__name__}: {exc}", flush=True)
            if name == "eager":
                raise
            continue
        reference = latents if reference is None else reference
        rows.append(row)
    eager = rows[0]
    print(f"\n{args.size}x{args.size}, {args.steps} steps, batch 1, bf16 weights")
    print("| scenario | step ms | speedup | s / image | compile s | peak GiB | rel. error vs eager |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        row["speedup"] = eager["step_ms"] / row["step_ms"]
        compile_s = "-" if row["compile_s"] is None else f"{row['compile_s']:.1f}"
        print(
            f"| {row['scenario']} | {row['step_ms']:.1f} | {row['speedup']:.2f}x | {row['s_per_image']:.2f} "
            f"| {compile_s} | {row['peak_gib']:.1f} | {row['rel_error']:.1e} |"
        )
    print(json.dumps({**environment(), "size": args.size, "steps": args.steps, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

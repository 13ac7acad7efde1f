"""FP8 attention's error as attention sharpens: what `FP8_ATTENTION_MAX_REL_ERROR` stands for.

Random weights give flat attention (every query spreads over thousands of keys), which hides FA3's
FP8 rounding of Q, K and the softmax's probabilities; trained models attend more sharply. This sweep
multiplies the query and key norms' weights of FLUX.1-dev's transformer (`tools.bench`'s seeded
random weights) by each `--sharpness` s, which multiplies every attention logit by s^2, and measures
at each, against the eager pipeline with SDPA, bf16 FA3 and FA3's FP8 forward (`fa3-fp8`):

    largest p      the mean over queries of the largest softmax probability (first double block, first step)
    keys           the mean over queries of exp(entropy): how many keys a query effectively reads
    block error    ||block - eager block|| / ||eager block|| on its captured inputs (the first
                   block of each class, eager, linear layers in bf16): what the `fa3-fp8` trial
                   holds to `FP8_ATTENTION_MAX_REL_ERROR` (export.py)
    latents error  the same for the latents after `--steps` steps, same seed
    PSNR dB        10 log10(2^2 / MSE) of the decoded image (values in [-1, 1]) against eager's

Prints a markdown table, then one JSON line (date, GPU, versions, commit, rows), appended to
`--results`. Needs a Hopper GPU and FA3 (from `AOT_FA3_KERNEL`); takes about a minute on an H100:

    python -m tools.attention_error --sharpness 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from aot.attention import attention_backend, replaced_backend
from aot.blocks import rel_error, repeated_blocks
from aot.export import capture_blocks
from aot.fa3 import load_fa3
from aot.options import Options
from tools.bench import PROMPTS, ROOT, environment, random_flux_dev

KERNELS = ("fa3", "fa3-fp8")  # each against eager SDPA
NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def attention_shape(query: torch.Tensor, key: torch.Tensor) -> dict[str, float]:
    """`largest p` and `keys` (the module docstring) of one attention call, `query` and `key`
    (batch, seq, heads, head_dim), over every 16th query of the first batch entry."""
    q, k = query[0, ::16].float(), key[0].float()
    p = (torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])).softmax(-1)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    return {"largest_p": p.amax(-1).mean().item(), "keys": entropy.exp().mean().item()}


def first_attention(pipe, firsts: dict[str, torch.nn.Module]) -> tuple[dict, dict[str, float]]:
    """One pipeline call at 1024x1024 (the family's `min_steps`): each block class's first block's
    captured inputs, and `attention_shape` of the first attention call diffusers' dispatcher makes."""
    shape: dict[str, float] = {}

    def spy(sdpa):
        def call(query, key, value, **kwargs):
            shape.update(shape or attention_shape(query, key))
            return sdpa(query=query, key=key, value=value, **kwargs)

        return call

    with replaced_backend("native", spy):
        return capture_blocks(pipe, firsts, [(1024, 1024)])[0], shape


def decoded(pipe, latents: torch.Tensor, size: int) -> torch.Tensor:
    """FLUX's packed `latents` through the VAE: the image, float32 in [-1, 1]."""
    latents = pipe._unpack_latents(latents, size, size, pipe.vae_scale_factor)
    latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    return pipe.vae.decode(latents, return_dict=False)[0].float().clamp(-1, 1)


def psnr(image: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR in dB of `image` against `reference`, both in [-1, 1] (peak-to-peak 2)."""
    mse = (image - reference).square().mean().item()
    return 10 * math.log10(4 / mse) if mse > 0 else math.inf


def sweep(pipe, sharpness: list[float], steps: int) -> list[dict]:
    """One row per s in `sharpness` (the module docstring); leaves the norms' weights as they were."""
    transformer = pipe.transformer
    firsts = {name: found[0] for name, found in repeated_blocks(transformer).items()}
    norms = [m for n, m in transformer.named_modules() if n.rsplit(".", 1)[-1] in NORMS]
    weights = [norm.weight.detach().clone() for norm in norms]
    rows = []
    try:
        for s in sharpness:
            for norm, weight in zip(norms, weights, strict=True):
                norm.weight.data = weight * s
            captured, shape = first_attention(pipe, firsts)
            row = {"sharpness": s, **shape, "block_error": {}, "latents_error": {}, "psnr": {}}
            with torch.no_grad():
                for name, block in firsts.items():
                    kwargs = captured[name][1]
                    reference = block(**kwargs)
                    for kernel in KERNELS:
                        with attention_backend(kernel):
                            row["block_error"][f"{name} {kernel}"] = rel_error(block(**kwargs), reference)
                latents, images = {}, {}
                for kernel in ("sdpa", *KERNELS):
                    generator = torch.Generator(transformer.device).manual_seed(0)
                    with attention_backend(kernel):
                        call = dict(num_inference_steps=steps, generator=generator, output_type="latent")
                        latents[kernel] = pipe(PROMPTS[0], height=1024, width=1024, **call).images
                    images[kernel] = decoded(pipe, latents[kernel], 1024)
            for kernel in KERNELS:
                row["latents_error"][kernel] = rel_error(latents[kernel], latents["sdpa"])
                row["psnr"][kernel] = psnr(images[kernel], images["sdpa"])
            rows.append(row)
    finally:
        for norm, weight in zip(norms, weights, strict=True):
            norm.weight.data = weight
    return rows


def table(rows: list[dict]) -> str:
    """The sweep as a markdown table, one line per sharpness."""
    blocks = list(rows[0]["block_error"])
    head = ["s", "largest p", "keys", *(f"{b} block error" for b in blocks)]
    head += [f"{k} latents error" for k in KERNELS] + [f"{k} PSNR dB" for k in KERNELS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [f"{row['sharpness']:g}", f"{row['largest_p']:.3f}", f"{row['keys']:.1f}"]
        cells += [f"{row['block_error'][b]:.1e}" for b in blocks]
        cells += [f"{row['latents_error'][k]:.1e}" for k in KERNELS] + [f"{row['psnr'][k]:.1f}" for k in KERNELS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sharpness", default="1,2,4,8,16", help="factors on the q/k norms' weights, comma-separated")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results.jsonl"), help="'' for none")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU that runs FA3 (Hopper)")
    load_fa3(Options.from_env().fa3_kernel)
    sharpness = [float(s) for s in args.sharpness.split(",")]
    rows = sweep(random_flux_dev("cuda"), sharpness, args.steps)
    print(table(rows))
    line = json.dumps({**environment(), "tool": "attention_error", "steps": args.steps, "rows": rows})
    print(line)
    if args.results:
        with Path(args.results).open("a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

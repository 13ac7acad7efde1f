"""Build `assets/tiny-chroma/`: a real `ChromaPipeline` (Chroma1-HD's structure) with small random weights.

Chroma is FLUX.1-schnell re-trained without CLIP: T5 is the only text encoder, the per-block modulation
comes from a small MLP (the "distilled guidance layer" / approximator) instead of per-block linear layers,
and the text tokens are masked in attention. Kept here: both repeated block classes (two of each), the
approximator, rotary embeddings, the T5 sequence embedding with its attention mask, and the FLUX VAE with
2x2 packing (16 px per image token). Only the widths are tiny; the T5 tokenizer and VAE are
`make_tiny_flux.py`'s.

    python assets/make_tiny_chroma.py          # rewrites assets/tiny-chroma/ (seeded: same weights)
"""

from pathlib import Path

import torch
from diffusers import AutoencoderKL, ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
from make_tiny_flux import SCHEDULER, SEED, VAE, t5_encoder, t5_tokenizer
from tiny_common import main

OUT = Path(__file__).parent / "tiny-chroma"
# diffusers' tiny Chroma test config (tests/pipelines/chroma), with two blocks of each class and a 16-channel
# packed input (4 latent channels x 2x2).
TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=[4, 4, 8],
    approximator_hidden_dim=32,
    approximator_layers=1,
    approximator_num_channels=16,
)
# Chroma1-HD's own scheduler_config.json was not found offline; these are FLUX.1-dev's values (the pipeline
# reads the same keys: dynamic shifting from base/max_image_seq_len and base/max_shift).
SCHEDULER = SCHEDULER
# lodestones/Chroma1-HD transformer/config.json: ChromaTransformer2DModel's defaults, whose docstring names
# Chroma1-HD as the reference, and which diffusers' single-file loader uses for Chroma checkpoints
# (loaders/single_file_utils.py maps "chroma" to lodestones/Chroma1-HD).
PUBLISHED_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    axes_dims_rope=[16, 56, 56],
    approximator_num_channels=64,
    approximator_hidden_dim=5120,
    approximator_layers=5,
)


def build() -> ChromaPipeline:
    """Return the seeded tiny pipeline (float32, CPU)."""
    torch.manual_seed(SEED)
    tokenizer = t5_tokenizer()
    return ChromaPipeline(
        transformer=ChromaTransformer2DModel(**TRANSFORMER),
        vae=AutoencoderKL(**VAE),
        text_encoder=t5_encoder(len(tokenizer), TRANSFORMER["joint_attention_dim"]),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    )


if __name__ == "__main__":
    main(__doc__, build, OUT)

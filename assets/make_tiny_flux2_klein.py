"""Build `assets/tiny-flux2-klein/`: a real `Flux2KleinPipeline` (FLUX.2 [klein] 4B's structure), tiny, seeded.

FLUX.2 keeps FLUX.1's two block classes (`Flux2TransformerBlock` double-stream, `Flux2SingleTransformerBlock`
single-stream) but shares the modulation across blocks, uses 4-axis rotary embeddings, and reads its text
from a Qwen3 causal LM: the hidden states of layers 9, 18 and 27 stacked into a 3 x hidden_size feature per
token. Kept here: two blocks of each class, that 3-layer read-out (so the text encoder has 28 layers, tiny
ones), the chat template with thinking switched off, the FLUX.2 VAE (8x downsampling, then 2x2 patchify and a
batch norm over the patchified latents: 16 px per image token) and the step-distilled setting of
FLUX.2-klein-4B (`is_distilled=True`: no classifier-free guidance, so one transformer call per step). Only the
widths are tiny; the tokenizer is `tiny_common.qwen_tokenizer`.

    python assets/make_tiny_flux2_klein.py     # rewrites assets/tiny-flux2-klein/ (seeded: same weights)
"""

from pathlib import Path

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from make_tiny_flux import SCHEDULER, SEED
from tiny_common import main, qwen_tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

OUT = Path(__file__).parent / "tiny-flux2-klein"
LATENT_CHANNELS = 4
QWEN3_WIDTH = 16
# diffusers' tiny FLUX.2 klein test config (tests/pipelines/flux2), with two blocks of each class, 4 latent
# channels x 2x2 patchify, and text features of three Qwen3 layers.
TRANSFORMER = dict(
    patch_size=1,
    in_channels=LATENT_CHANNELS * 4,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=3 * QWEN3_WIDTH,
    timestep_guidance_channels=256,
    axes_dims_rope=[4, 4, 4, 4],
    guidance_embeds=False,
)
# Four resolution levels (vae_scale_factor 8) as in FLUX.2's VAE; quant convs and the latent batch norm kept.
VAE = dict(
    block_out_channels=[4, 4, 4, 4],
    layers_per_block=1,
    latent_channels=LATENT_CHANNELS,
    norm_num_groups=2,
    sample_size=32,
)
TEXT_ENCODER = dict(
    hidden_size=QWEN3_WIDTH,
    intermediate_size=16,
    num_hidden_layers=28,  # the pipeline reads hidden states 9, 18 and 27
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
# diffusers' scripts/convert_flux2_to_diffusers.py saves FLUX.1-dev's scheduler config with FLUX.2 pipelines; the
# pipeline computes its own shift (compute_empirical_mu) from the image token count and the step count.
SCHEDULER = SCHEDULER
# black-forest-labs/FLUX.2-klein-4B transformer/config.json: the "klein-4b" entry of diffusers'
# scripts/convert_flux2_to_diffusers.py (get_flux2_transformer_config).
PUBLISHED_TRANSFORMER = dict(
    patch_size=1,
    in_channels=128,
    num_layers=5,
    num_single_layers=20,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=7680,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=[32, 32, 32, 32],
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)


def build() -> Flux2KleinPipeline:
    """Return the seeded tiny pipeline (float32, CPU)."""
    torch.manual_seed(SEED)
    tokenizer = qwen_tokenizer(model_max_length=512)
    return Flux2KleinPipeline(
        transformer=Flux2Transformer2DModel(**TRANSFORMER),
        vae=AutoencoderKLFlux2(**VAE),
        text_encoder=Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), **TEXT_ENCODER)),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        is_distilled=True,
    )


if __name__ == "__main__":
    main(__doc__, build, OUT)

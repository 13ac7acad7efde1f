"""Build `assets/tiny-z-image/`: a real `ZImagePipeline` (Z-Image-Turbo's structure), tiny and seeded.

Z-Image is a single-stream DiT: the image tokens go through `noise_refiner` blocks (modulated by the
timestep), the caption tokens through `context_refiner` blocks (the same `ZImageTransformerBlock` class
built with `modulation=False`: no `adaLN_modulation` weights), then the concatenated sequence through the
main modulated `layers`. Kept here: that layout with two blocks in each group (six blocks of the one
repeated class, two weight layouts), 2x2 patchifying inside the transformer, 3-axis rotary embeddings, a
Qwen3 text encoder whose second-to-last hidden state is the caption, and an AutoencoderKL that downsamples
by 8 (16 px per image token, as Z-Image-Turbo's FLUX VAE). Only the widths are tiny; the Qwen tokenizer is
built offline by `tiny_common.qwen_tokenizer` with a Qwen3-style chat template.

    python assets/make_tiny_z_image.py         # rewrites assets/tiny-z-image/ (seeded: same weights)
"""

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from make_tiny_flux import SEED, VAE
from tiny_common import main, qwen_tokenizer
from transformers import Qwen3Config, Qwen3Model

OUT = Path(__file__).parent / "tiny-z-image"
# diffusers' tiny Z-Image test config (tests/pipelines/z_image), with two refiner blocks of each kind and the
# VAE's 4 latent channels.
TRANSFORMER = dict(
    all_patch_size=[2],
    all_f_patch_size=[1],
    in_channels=4,
    dim=32,
    n_layers=2,
    n_refiner_layers=2,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=16,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[8, 4, 4],
    axes_lens=[1536, 512, 512],  # Z-Image-Turbo's: the rotary tables bound the caption length and the image side
)
# Z-Image-Turbo's VAE is FLUX.1's: these are its scaling and shift factors.
VAE = {**VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: a fixed shift, no dynamic shifting.
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
TEXT_ENCODER = dict(
    hidden_size=TRANSFORMER["cap_feat_dim"],
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)
# Tongyi-MAI/Z-Image-Turbo transformer/config.json, as quoted verbatim (same numbers) in several public
# repositories' conversion scripts and tests, e.g. an mlx port's "From https://huggingface.co/Tongyi-MAI/
# Z-Image-Turbo/blob/main/transformer/config.json" block.
PUBLISHED_TRANSFORMER = dict(
    all_patch_size=[2],
    all_f_patch_size=[1],
    in_channels=16,
    dim=3840,
    n_layers=30,
    n_refiner_layers=2,
    n_heads=30,
    n_kv_heads=30,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=2560,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[32, 48, 48],
    axes_lens=[1536, 512, 512],
)


def build() -> ZImagePipeline:
    """Return the seeded tiny pipeline (float32, CPU)."""
    torch.manual_seed(SEED)
    tokenizer = qwen_tokenizer(model_max_length=512)
    transformer = ZImageTransformer2DModel(**TRANSFORMER)
    with torch.no_grad():  # created with torch.empty: give them seeded values
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()
    return ZImagePipeline(
        transformer=transformer,
        vae=AutoencoderKL(**VAE),
        text_encoder=Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), **TEXT_ENCODER)),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    )


if __name__ == "__main__":
    main(__doc__, build, OUT)

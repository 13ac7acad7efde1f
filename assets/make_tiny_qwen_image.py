"""Build `assets/tiny-qwen-image/`: a real `QwenImagePipeline` (Qwen-Image's structure), tiny and seeded.

Qwen-Image is a dual-stream MMDiT with one repeated block class (`QwenImageTransformerBlock`: separate
image and text weights, joint attention) conditioned by the last hidden state of a Qwen2.5-VL model read
through a chat template whose first 34 tokens (the system prompt, in the real tokenizer) are dropped.
Kept here: two blocks, 2x2 packing into 16-channel tokens, 3-axis rotary embeddings, a full
Qwen2_5_VLForConditionalGeneration (text model with multimodal rotary sections and a vision tower, unused
for text-only prompts), and the causal 3D AutoencoderKLQwenImage with three downsampling stages
(vae_scale_factor 8: 16 px per image token, as in Qwen-Image). Only the widths are tiny. The tokenizer is
`tiny_common.qwen_tokenizer` (byte-level, built offline): the system prompt is 34 tokens as with the real
vocabulary, so the dropped tokens end where the user's text starts; the user's words fall back to bytes, so a
prompt is longer in tokens than with the real vocabulary.

    python assets/make_tiny_qwen_image.py      # rewrites assets/tiny-qwen-image/ (seeded: same weights)
"""

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from make_tiny_flux import SEED
from tiny_common import QWEN_SPECIALS, main, qwen_tokenizer
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

OUT = Path(__file__).parent / "tiny-qwen-image"
Z_DIM = 4
# diffusers' tiny Qwen-Image test config (tests/pipelines/qwenimage): 4 latent channels x 2x2 packing.
TRANSFORMER = dict(
    patch_size=2,
    in_channels=Z_DIM * 4,
    out_channels=Z_DIM,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=3,
    joint_attention_dim=16,
    guidance_embeds=False,
    axes_dims_rope=[8, 4, 4],
)
# Qwen-Image's VAE layout (three downsampling stages, temporal downsampling in the last two, attention in the
# middle block), 4 channels wide.
VAE = dict(
    base_dim=4,
    z_dim=Z_DIM,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    latents_mean=[0.0] * Z_DIM,
    latents_std=[1.0] * Z_DIM,
)
# Qwen/Qwen-Image scheduler/scheduler_config.json (quoted identically by several public trainers and ports,
# e.g. ai-toolkit's and SimpleTuner's Qwen-Image models): exponential dynamic shifting up to 8192 tokens, and a
# terminal shift of 0.02.
SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    invert_sigmas=False,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    stochastic_sampling=False,
    time_shift_type="exponential",
    use_beta_sigmas=False,
    use_dynamic_shifting=True,
    use_exponential_sigmas=False,
    use_karras_sigmas=False,
)
# Qwen/Qwen-Image transformer/config.json (its fields as quoted in public ports and trainers, e.g. musubi-tuner's
# qwen_image model.py docstring; equal to QwenImageTransformer2DModel's defaults).
PUBLISHED_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=[16, 56, 56],
)


def qwen_vl_config(tokenizer) -> Qwen2_5_VLConfig:
    """diffusers' tiny Qwen2.5-VL test config, with this tokenizer's vocabulary and vision token ids."""
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIALS}
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=TRANSFORMER["joint_attention_dim"],
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[1, 1, 2]),
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=16,
            num_heads=2,
            out_hidden_size=TRANSFORMER["joint_attention_dim"],
            fullatt_block_indexes=[1],  # one windowed and one full-attention vision block, as the real tower mixes
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def components() -> dict:
    """The seeded components shared with the edit pipeline (float32, CPU)."""
    torch.manual_seed(SEED)
    tokenizer = qwen_tokenizer(model_max_length=1024)
    return dict(
        transformer=QwenImageTransformer2DModel(**TRANSFORMER),
        vae=AutoencoderKLQwenImage(**VAE),
        text_encoder=Qwen2_5_VLForConditionalGeneration(qwen_vl_config(tokenizer)),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    )


def build() -> QwenImagePipeline:
    """Return the seeded tiny pipeline (float32, CPU)."""
    return QwenImagePipeline(**components())


if __name__ == "__main__":
    main(__doc__, build, OUT)

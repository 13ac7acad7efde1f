"""Build `assets/tiny-flux/`: a real `FluxPipeline` with small random weights, for offline tests.

It keeps FLUX's structure where the recipe cares: both repeated block classes (two of each, so one
package is bound to several blocks' weights), rotary embeddings, the guidance embedding, CLIP pooled
and T5 sequence embeddings, a VAE that downsamples by 8 with 2x2 latent packing (so image tokens =
(height/16) * (width/16), as in FLUX.1-dev), and FLUX.1-dev's scheduler settings. Only the widths
are tiny. The tokenizers are built here from a character vocabulary: any text gets ids below each
text encoder's vocabulary size.

    python assets/make_tiny_flux.py            # rewrites assets/tiny-flux/ (seeded: same weights)
"""

import argparse
import string
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

SEED = 0
OUT = Path(__file__).parent / "tiny-flux"

# diffusers' own tiny FLUX test config, with two blocks of each class and a 16-channel packed input.
TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,  # 4 latent channels x 2x2 packing
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=[4, 4, 8],
)
# black-forest-labs/FLUX.1-dev transformer/config.json (bench.py builds it with random weights).
PUBLISHED_TRANSFORMER = dict(
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
# Four resolution levels: vae_scale_factor = 2 ** (4 - 1) = 8, as in FLUX.1-dev's VAE.
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[4, 4, 4, 4],
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=2,
    sample_size=32,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.0609,
    scaling_factor=1.5035,
)
# FLUX.1-dev's scheduler_config.json.
SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)
CHARS = string.ascii_lowercase + string.digits + string.punctuation


def clip_tokenizer() -> CLIPTokenizer:
    """A byte-level-BPE CLIP tokenizer over single characters (no merges)."""
    specials = ["<|startoftext|>", "<|endoftext|>"]
    pieces = list(CHARS) + [c + "</w>" for c in CHARS]
    vocab = {piece: i for i, piece in enumerate(specials + pieces)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer() -> T5Tokenizer:
    """A unigram T5 tokenizer over single characters; ids 0, 1, 2 are pad, eos, unk as in T5."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in CHARS] + [("\u2581" + c, -1.5) for c in CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def t5_encoder(vocab_size: int, d_model: int) -> T5EncoderModel:
    """A two-layer T5 encoder of width `d_model` (random weights from the current torch seed)."""
    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=d_model,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def build(transformer: dict = TRANSFORMER, scheduler: dict = SCHEDULER, pipeline_class=FluxPipeline) -> FluxPipeline:
    """Return the seeded tiny pipeline (float32, CPU).

    The FLUX.1 variants (schnell, Kontext) share these components and differ only in the transformer's
    config fields, the scheduler's config and the pipeline class, so their scripts call this with their own.
    """
    torch.manual_seed(SEED)
    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=transformer["pooled_projection_dim"],
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            projection_dim=32,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    text_encoder_2 = t5_encoder(len(tokenizer_2), transformer["joint_attention_dim"])
    return pipeline_class(
        transformer=FluxTransformer2DModel(**transformer),
        vae=AutoencoderKL(**VAE),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: %(default)s)")
    build().save_pretrained(parser.parse_args().out)

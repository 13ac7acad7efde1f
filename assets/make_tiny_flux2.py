"""Build `assets/tiny-flux2/`: a real `Flux2Pipeline` (FLUX.2 [dev]'s structure), tiny and seeded.

FLUX.2 [dev] has FLUX.2 [klein]'s transformer layout (see `make_tiny_flux2_klein.py`) with a guidance
embedding (guidance-distilled: `guidance_scale` goes into the model, one transformer call per step) and reads
its text from Mistral Small 3.1 (`Mistral3ForConditionalGeneration`): the hidden states of layers 10, 20 and
30 stacked into a 3 x hidden_size feature per token. Its `tokenizer` component is a `PixtralProcessor`.
Kept here: two blocks of each class, that read-out (so the Mistral text model has 31 layers, tiny ones), a
Pixtral vision tower, a processor built offline (`tiny_common.mistral_tokenizer` with merges trained on
FLUX.2's system message, and a Pixtral image processor), and the FLUX.2 VAE of `make_tiny_flux2_klein.py`
(16 px per image token). transformers' PixtralProcessor cannot be built or loaded without torchvision, so this
pipeline needs torchvision installed.

    python assets/make_tiny_flux2.py           # rewrites assets/tiny-flux2/ (seeded: same weights)
"""

from pathlib import Path

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from make_tiny_flux import SEED
from make_tiny_flux2_klein import SCHEDULER, VAE
from make_tiny_flux2_klein import TRANSFORMER as KLEIN
from tiny_common import main, mistral_tokenizer
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessor, PixtralProcessor

OUT = Path(__file__).parent / "tiny-flux2"
MISTRAL_WIDTH = 16
TRANSFORMER = {**KLEIN, "joint_attention_dim": 3 * MISTRAL_WIDTH, "guidance_embeds": True}
# diffusers' tiny Pixtral vision tower (tests/pipelines/flux2): 30 px images in 6 px patches.
PATCH = 6
# black-forest-labs/FLUX.2-dev transformer/config.json: the "flux2-dev" entry of diffusers'
# scripts/convert_flux2_to_diffusers.py (get_flux2_transformer_config); guidance_embeds is the class default (True).
PUBLISHED_TRANSFORMER = dict(
    patch_size=1,
    in_channels=128,
    num_layers=8,
    num_single_layers=48,
    attention_head_dim=128,
    num_attention_heads=48,
    joint_attention_dim=15360,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=[32, 32, 32, 32],
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=True,
)


def mistral3_config(tokenizer) -> Mistral3Config:
    """diffusers' tiny Mistral3 test config with 31 text layers and this tokenizer's vocabulary and ids."""
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=len(tokenizer),
            hidden_size=MISTRAL_WIDTH,
            intermediate_size=37,
            max_position_embeddings=512,
            num_attention_heads=4,
            num_hidden_layers=31,  # the pipeline reads hidden states 10, 20 and 30
            num_key_value_heads=2,
            rms_norm_eps=1e-05,
            rope_parameters=dict(rope_type="default", rope_theta=1000000000.0),
            sliding_window=None,
            **ids,
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=37,
            image_size=5 * PATCH,
            patch_size=PATCH,
            num_channels=3,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        vision_feature_layer=-1,
        **ids,
    )


def build() -> Flux2Pipeline:
    """Return the seeded tiny pipeline (float32, CPU)."""
    torch.manual_seed(SEED)
    tokenizer = mistral_tokenizer([SYSTEM_MESSAGE], model_max_length=512)
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(patch_size={"height": PATCH, "width": PATCH}, size={"longest_edge": 60}),
        tokenizer=tokenizer,
        patch_size=PATCH,
        spatial_merge_size=2,  # Mistral3's patch merger default
        chat_template=tokenizer.chat_template,
    )
    return Flux2Pipeline(
        transformer=Flux2Transformer2DModel(**TRANSFORMER),
        vae=AutoencoderKLFlux2(**VAE),
        text_encoder=Mistral3ForConditionalGeneration(mistral3_config(tokenizer)),
        tokenizer=processor,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    )


if __name__ == "__main__":
    main(__doc__, build, OUT)

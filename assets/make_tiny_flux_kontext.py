"""Build `assets/tiny-flux-kontext/`: a real `FluxKontextPipeline` (FLUX.1-Kontext image editing), tiny.

FLUX.1-Kontext-dev has FLUX.1-dev's components (guidance-distilled transformer, CLIP + T5, 16-channel VAE),
so this is `make_tiny_flux.py`'s seeded pipeline under the Kontext pipeline class. What Kontext adds is in
the pipeline, not the weights: the input image is encoded, packed into 2x2 tokens and appended to the
image sequence (its position ids carry index 1 in the first axis), so the blocks see
(height/16)*(width/16) + (image_height/16)*(image_width/16) image tokens.

    python assets/make_tiny_flux_kontext.py    # rewrites assets/tiny-flux-kontext/ (seeded: same weights)
"""

from pathlib import Path

from diffusers import FluxKontextPipeline
from make_tiny_flux import PUBLISHED_TRANSFORMER as FLUX_DEV
from make_tiny_flux import SCHEDULER, TRANSFORMER
from make_tiny_flux import build as build_flux
from tiny_common import main

OUT = Path(__file__).parent / "tiny-flux-kontext"
# black-forest-labs/FLUX.1-Kontext-dev transformer/config.json is FLUX.1-dev's: Black Forest Labs' reference code
# (flux/src/flux/util.py, configs["flux-dev-kontext"]) gives it depth 19, 38 single blocks, hidden 3072 = 24 x 128,
# context 4096, vec 768, axes (16, 56, 56) and guidance_embed=True.
PUBLISHED_TRANSFORMER = FLUX_DEV


def build() -> FluxKontextPipeline:
    """Return the seeded tiny pipeline (float32, CPU)."""
    return build_flux(TRANSFORMER, SCHEDULER, FluxKontextPipeline)


if __name__ == "__main__":
    main(__doc__, build, OUT)

"""Build `assets/tiny-flux-schnell/`: a real `FluxPipeline` of the timestep-distilled FLUX.1-schnell kind.

Everything is tiny FLUX.1 as in `make_tiny_flux.py` (same seeded components, two blocks of each class,
16 px per image token), except what makes schnell schnell: the transformer has no guidance embedding
(`guidance_embeds=False`, so the pipeline passes `guidance=None` and `guidance_scale` is ignored) and the
scheduler uses a fixed shift of 1.0 without resolution-dependent (dynamic) shifting.

    python assets/make_tiny_flux_schnell.py    # rewrites assets/tiny-flux-schnell/ (seeded: same weights)
"""

from pathlib import Path

from make_tiny_flux import PUBLISHED_TRANSFORMER as FLUX_DEV
from make_tiny_flux import SCHEDULER, TRANSFORMER
from make_tiny_flux import build as build_flux
from tiny_common import main

OUT = Path(__file__).parent / "tiny-flux-schnell"
TRANSFORMER = {**TRANSFORMER, "guidance_embeds": False}
# FLUX.1-schnell's scheduler_config.json differs from FLUX.1-dev's in these two fields (shift 1.0, static), as
# quoted from the published configs in a public diffusers FLUX integration report.
SCHEDULER = {**SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}
# black-forest-labs/FLUX.1-schnell transformer/config.json: diffusers' scripts/convert_flux_to_diffusers.py builds
# it as FluxTransformer2DModel's defaults with num_layers=19, num_single_layers=38 and guidance_embeds=False
# (no "guidance_in" weights in flux1-schnell.sft); Black Forest Labs' flux/src/flux/util.py has the same numbers:
# FLUX.1-dev's config without the guidance embedding.
PUBLISHED_TRANSFORMER = {**FLUX_DEV, "guidance_embeds": False}


def build():
    """Return the seeded tiny pipeline (float32, CPU)."""
    return build_flux(TRANSFORMER, SCHEDULER)


if __name__ == "__main__":
    main(__doc__, build, OUT)

"""Build `assets/tiny-qwen-image-edit/`: a real `QwenImageEditPipeline` (Qwen-Image-Edit), tiny and seeded.

Qwen-Image-Edit has Qwen-Image's components plus a `Qwen2VLProcessor`: the input image goes twice into the
model, once through the Qwen2.5-VL vision tower (its `<|image_pad|>` token becomes one token per 2x2 group
of 14 px patches inside the prompt embedding) and once through the VAE, packed into tokens appended to the
image sequence. The components are `make_tiny_qwen_image.py`'s (same seed, same weights); the processor is
built offline from the tiny Qwen tokenizer and a Qwen2-VL image processor with Qwen2.5-VL's published pixel
bounds (patch 14, merge 2, 3136 to 12845056 pixels). transformers' Qwen2VLProcessor cannot be built or
loaded without torchvision (its video processor needs it), so this pipeline needs torchvision installed.

    python assets/make_tiny_qwen_image_edit.py # rewrites assets/tiny-qwen-image-edit/ (seeded: same weights)
"""

from pathlib import Path

from diffusers import QwenImageEditPipeline
from make_tiny_qwen_image import PUBLISHED_TRANSFORMER, components
from tiny_common import main
from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

OUT = Path(__file__).parent / "tiny-qwen-image-edit"
# Qwen2.5-VL's preprocessor_config.json: min_pixels 56*56, max_pixels 28*28*16384.
IMAGE_PROCESSOR = dict(size={"shortest_edge": 3136, "longest_edge": 12845056}, patch_size=14, merge_size=2)
# Qwen/Qwen-Image-Edit's transformer/config.json equals Qwen-Image's (a public architecture write-up quotes the
# Edit repository's config.json: the same ten fields and values).
PUBLISHED_TRANSFORMER = PUBLISHED_TRANSFORMER


def build() -> QwenImageEditPipeline:
    """Return the seeded tiny pipeline (float32, CPU)."""
    parts = components()
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**IMAGE_PROCESSOR),
        tokenizer=parts["tokenizer"],
        video_processor=Qwen2VLVideoProcessor(),  # unused, but the processor requires one (and so torchvision)
    )
    return QwenImageEditPipeline(**parts, processor=processor)


if __name__ == "__main__":
    main(__doc__, build, OUT)

"""What differs between the pipelines this template compiles, as data: one row per pipeline class.

Everything else (capture, export, the shape contract, the UI) reads these rows through `family()`;
no other file branches on a model or pipeline name. A row says which inputs the UI offers, which
keyword arguments a call takes, the default steps and guidance, and the token rule:

* image tokens: `(H / step) * (W / step)` for an output of H x W pixels, step = 2 x the VAE's
  downsampling (every family here packs 2x2 latents). An edit family's input image is resized to the
  output size first (`reference_kwargs` turn off the pipeline's own resizing), so the transformer
  sees `2 * tokens` image tokens: the reference's as many again. The exported dimension is then
  `2 * image_tokens + offset` (`blocks.contract_from_captures` finds the factor from the captures).
* text tokens (`text_rule`): FLUX.1, Kontext, Chroma and FLUX.2 pad the prompt to
  `max_sequence_length` (512): the text length is a constant of the compiled blocks ("padded").
  Qwen-Image's text length follows the prompt ("prompt"), and padding it would change the image: its
  transformer attends to every text token it is given (no mask for a batch of one). So its text
  length is a second dynamic dimension, found by capturing once more with a longer prompt, from
  `MIN_TEXT_TOKENS` to `max_sequence_length`. A prompt cut at `max_sequence_length` gets a note in
  the UI either way.

    >>> family("FluxPipeline").image_input
    'none'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    """One pipeline class: how to call it, what the UI offers, and its token rule.

    guidance_kwarg: the call argument the UI's Guidance slider sets, or None (no slider).
    guided_when: (where, config field, value) under which the model takes guidance at all: where is
        "transformer" (its config) or "pipeline" (`pipe.config`); None: always. FLUX.1-schnell has no
        guidance embedding; FLUX.2 klein's step-distilled models set `is_distilled`.
    steps, guidance: UI defaults with guidance; unguided_steps: the default without it.
    image_input: "none" (text to image) or "required" (image editing: the input image is the call's
        `image` argument, resized by the app to the output size).
    reference_kwargs: call arguments that stop the pipeline's own resizing of the input image, as
        functions of (height, width), so the reference's image tokens equal the output's.
    call_kwargs: fixed call arguments (the text length the blocks are compiled for).
    capture_steps: denoising steps of a capture call (>= 2 where one step gives NaN timesteps).
    text_rule: "padded" (text length fixed at `max_sequence_length`) or "prompt" (it follows the
        prompt: a dynamic dimension of `text_range`).
    requires: Python modules the pipeline's components need beyond requirements.txt (FLUX.2 dev's
        Pixtral processor needs torchvision); `missing()` names those not installed.
    tokenizer: the pipeline attribute whose tokenizer counts the prompt against
        `max_sequence_length` for the UI's truncation note; None: no note.
    """

    pipeline: str
    label: str
    guidance_kwarg: str | None
    steps: int
    guidance: float
    unguided_steps: int = 4
    guided_when: tuple[str, str, bool] | None = None
    image_input: str = "none"
    reference_kwargs: dict[str, Any] = field(default_factory=dict)
    call_kwargs: dict[str, Any] = field(default_factory=lambda: {"max_sequence_length": 512})
    capture_steps: int = 1
    tokenizer: str | None = None
    text_rule: str = "padded"
    requires: tuple[str, ...] = ()

    @property
    def text_tokens(self) -> int:
        """The longest text the blocks take (`max_sequence_length`); with "padded", every text's length."""
        return self.call_kwargs["max_sequence_length"]

    @property
    def text_range(self) -> tuple[int, int] | None:
        """(min, max) text tokens of a "prompt" family's dynamic text dimension; None when padded."""
        return (MIN_TEXT_TOKENS, self.text_tokens) if self.text_rule == "prompt" else None

    def missing(self) -> list[str]:
        """The modules of `requires` that cannot be imported here."""
        import importlib.util

        return [name for name in self.requires if importlib.util.find_spec(name) is None]

    def guided(self, pipe: Any) -> bool:
        """Whether this model takes guidance (the UI shows the slider and uses `steps`/`guidance`)."""
        if self.guidance_kwarg is None:
            return False
        if self.guided_when is None:
            return True
        where, name, value = self.guided_when
        config = pipe.transformer.config if where == "transformer" else pipe.config
        return bool(config.get(name, False)) == value

    def defaults(self, pipe: Any) -> tuple[int, float]:
        """(steps, guidance) the UI starts with for `pipe`."""
        return (self.steps, self.guidance) if self.guided(pipe) else (self.unguided_steps, 0.0)

    def call(
        self, pipe: Any, prompt: str, height: int, width: int, steps: int, guidance: float, image: Any = None
    ) -> dict[str, Any]:
        """The keyword arguments of one pipeline call (all by keyword: edit pipelines take `image` first).

        `image` (a PIL image) is resized to `width` x `height` here, so its tokens follow the output's.

        Raises:
            ValueError: an edit family without an image, or an image for a text-to-image family.
        """
        kwargs = {"prompt": prompt, "height": height, "width": width, "num_inference_steps": steps, **self.call_kwargs}
        if self.guided(pipe):
            kwargs[self.guidance_kwarg] = guidance
        if self.image_input == "required":
            if image is None:
                raise ValueError(f"{self.label} ({self.pipeline}) edits an image: give an input image")
            kwargs["image"] = image.convert("RGB").resize((width, height))
            kwargs.update({k: v(height, width) if callable(v) else v for k, v in self.reference_kwargs.items()})
        elif image is not None:
            raise ValueError(f"{self.label} ({self.pipeline}) generates from text only: it takes no input image")
        return kwargs

    def capture_image(self, height: int, width: int) -> Any:
        """A fixed input image for capture calls of an edit family (None for text to image)."""
        if self.image_input != "required":
            return None
        from PIL import Image

        pixels = torch.arange(height * width * 3, dtype=torch.int64).reshape(height, width, 3) % 251
        return Image.fromarray(pixels.to(torch.uint8).numpy())


# The fewest text tokens a "prompt" family's blocks accept: torch.export specializes a dimension
# of size 0 or 1. Qwen-Image's prompt template leaves at least 5 tokens after its system prompt.
MIN_TEXT_TOKENS = 2
_FLUX_GUIDED = ("transformer", "guidance_embeds", True)
FAMILIES: dict[str, Family] = {
    f.pipeline: f
    for f in (
        # FLUX.1 dev (guidance-distilled: embedded guidance) and schnell (timestep-distilled: none).
        Family("FluxPipeline", "FLUX.1", "guidance_scale", 28, 3.5, guided_when=_FLUX_GUIDED, tokenizer="tokenizer_2"),
        Family(
            "FluxKontextPipeline",
            "FLUX.1 Kontext",
            "guidance_scale",
            28,
            2.5,
            guided_when=_FLUX_GUIDED,
            image_input="required",
            reference_kwargs={"max_area": lambda h, w: h * w, "_auto_resize": False},
            tokenizer="tokenizer_2",
        ),
        # Chroma: true classifier-free guidance (a second call with the negative prompt, same shapes).
        Family("ChromaPipeline", "Chroma", "guidance_scale", 28, 4.0, tokenizer="tokenizer"),
        # FLUX.2 klein: step-distilled checkpoints set is_distilled and ignore guidance.
        Family(
            "Flux2KleinPipeline",
            "FLUX.2 klein",
            "guidance_scale",
            50,
            4.0,
            guided_when=("pipeline", "is_distilled", False),
        ),
        Family("Flux2Pipeline", "FLUX.2", "guidance_scale", 50, 4.0, requires=("torchvision",)),
        # Qwen-Image: true classifier-free guidance against a negative prompt (its own text length);
        # one-step calls give NaN timesteps with its scheduler, so captures run two steps.
        Family(
            "QwenImagePipeline",
            "Qwen-Image",
            "true_cfg_scale",
            50,
            4.0,
            call_kwargs={"max_sequence_length": 512, "negative_prompt": " "},
            capture_steps=2,
            tokenizer="tokenizer",
            text_rule="prompt",
        ),
    )
}
# Pipelines a user may try, and why they are not served (yet).
UNSUPPORTED: dict[str, str] = {
    "WanPipeline": "video (frames are a third token dimension)",
    "WanImageToVideoPipeline": "video (frames are a third token dimension)",
    "LTXPipeline": "video (frames are a third token dimension)",
    "LTXImageToVideoPipeline": "video (frames are a third token dimension)",
    "StableDiffusion3Pipeline": "its transformer defines no `_repeated_blocks`",
    "SanaPipeline": "its transformer defines no `_repeated_blocks`",
    "HiDreamImagePipeline": "its transformer defines no `_repeated_blocks`",
    "QwenImageEditPipeline": "its text length follows the input image's vision tokens too (not built yet)",
    "QwenImageEditPlusPipeline": "its text length follows the input images' vision tokens too (not built yet)",
    "ZImagePipeline": (
        "its refiner and main blocks share one class and weight layout but see image-only and image + text "
        "sequences, and its text joins the image tokens in one dimension (not built yet)"
    ),
}


def family(pipeline_class: str) -> Family:
    """The row for a pipeline class name (`model_index.json`'s `_class_name`).

    Raises:
        ValueError: the class is not supported, naming why (where known) and what is.
    """
    if pipeline_class in FAMILIES:
        return FAMILIES[pipeline_class]
    why = UNSUPPORTED.get(pipeline_class, "no row in families.py")
    supported = ", ".join(f"{f.label} ({name})" for name, f in FAMILIES.items())
    raise ValueError(f"{pipeline_class} is not supported: {why}. Supported pipelines: {supported}")

"""What differs between the pipelines this template compiles, as data: one row per pipeline class.

Everything else (capture, export, the shape contract, the UI) reads these rows through `family()`;
no other file branches on a model or pipeline name. A row says which inputs the UI offers, which
keyword arguments a call takes, the default steps and guidance, and the token rule:

* image tokens: `(H / step) * (W / step)` for an output of H x W pixels, step = 2 x the VAE's
  downsampling (every family here packs 2x2 latents). An edit family's input image is fitted to the
  output size first (`reference_kwargs` turn off the pipeline's own resizing), so the transformer
  sees the reference's tokens after the output's: I = 2 x tokens ("required"), or 1 x or 2 x where
  the image is optional (FLUX.2). Z-Image pads each sequence to a multiple of 32 tokens
  (`sequence_multiple`). The packages are exported for every I in `image_range`.
* text tokens (`text_rule`): FLUX.1, Kontext, Chroma and FLUX.2 pad the prompt to
  `max_sequence_length` (512): the text length is a constant of the compiled blocks ("padded").
  Qwen-Image's and Z-Image's text length follows the prompt ("prompt"), and padding it would change
  the image: their transformers attend to every text token they are given (no mask for a batch of
  one). So the text length L is a second dynamic dimension, found by capturing once more with a
  longer prompt and read from the transformer's `text_input`, from `MIN_TEXT_TOKENS` to
  `max_sequence_length`. A prompt cut at `max_sequence_length` gets a note in the UI either way.
* a block input dim is `a * I + b * L + c` (contract.contract_from_captures): Z-Image's main blocks
  see image and text tokens in one sequence (a = b = 1).

What differs by family in the models' configs (the VAE's downsampling and latent channels, the
attention head dim) is read in model_config.py.

    >>> family("FluxPipeline").image_input
    'none'
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from PIL import Image
from torch.utils import _pytree as pytree

from aot import images
from aot.resolution import Resolution

# FLUX.1's attention and MLP layers in its two block classes (Chroma's have the same names). No row
# names its own yet: in FLUX.2's and Qwen-Image's blocks these match the attention only, in Z-Image's none.
_FLUX_LORA_TARGETS = ("attn.to_", "attn.add_", "ff.net", "ff_context.net", "proj_mlp", "proj_out")


@dataclass(frozen=True)
class Family:
    """One pipeline class: how to call it, what the UI offers, and its token rule.

    guidance_kwarg: the call argument the UI's Guidance slider sets, or None (no slider).
    guided_when: (where, config field, value) under which the model takes guidance at all: where is
        "transformer" (its config) or "pipeline" (`pipe.config`); None: always. FLUX.1-schnell has no
        guidance embedding; FLUX.2 klein's step-distilled models set `is_distilled`.
    steps, guidance: UI defaults with guidance; unguided_steps: the default without it.
    image_input: "none" (text to image), "required" (image editing: the input image is the call's
        `image` argument, fitted by the app to the output size) or "optional" (either).
    reference_kwargs: call arguments that stop the pipeline's own resizing of the input image, as
        functions of (height, width), so the reference's image tokens equal the output's.
    reference_size: where the pipeline resizes the input image anyway, (height, width) of the
        reference for an output of (height, width); None: the output's size. Qwen-Image-Edit resizes
        it to about 1 MP at the output's aspect ratio (diffusers' `calculate_dimensions`).
    call_kwargs: fixed call arguments (the text length the blocks are compiled for).
    min_steps: the fewest denoising steps that give a finite image: Qwen-Image's scheduler gives a
        NaN timestep for one step (so a NaN step and image). Requests of fewer are refused, and a
        capture call takes this many.
    text_rule: "padded" (text length fixed at `max_sequence_length`) or "prompt" (it follows the
        prompt: a dynamic dimension of `text_range`).
    text_input: the transformer's keyword argument holding the prompt's embeddings, [..., L, dim]:
        where a "prompt" family's text length L is read at capture.
    text_extra: text tokens beyond `max_sequence_length` (Qwen-Image-Edit's text holds the
        reference's vision tokens: (H/28)*(W/28) of its ~1 MP, at most 1.4k).
    sequence_multiple: the transformer pads image and text tokens to a multiple of this (Z-Image: 32).
    controls: fields of app.py's `Request` beyond the common ones that this pipeline takes as call
        arguments of the same name (the UI shows their widgets only for such a family).
    requires: Python modules the pipeline's components need beyond requirements.txt (FLUX.2 dev's
        Pixtral processor needs torchvision); `missing()` names those not installed.
    tokenizer: the pipeline attribute whose tokenizer counts the prompt against
        `max_sequence_length`: for the UI's truncation note, or to refuse a longer prompt where the
        pipeline does not cut it (`truncates`); None: not counted.
    truncates: whether the pipeline cuts the prompt at `max_sequence_length` (Qwen-Image-Edit's
        does not: a longer prompt would go past the text tokens the blocks are compiled for).

    Where the transformer's config keeps its sizes, for tools/bench.py (published shapes, random weights):
    layer_fields: the fields counting each block stack's blocks (`--layers` sets them).
    head_fields: the fields counting attention heads, query heads first (`--heads` sets them).
    width_field: the model width's field where it is not derived from the heads (Z-Image's `dim`,
        kept at the same head dim by `--heads`); None: heads x `attention_head_dim`.
    text_widths: the transformer's text-embedding inputs, each with the field of its width (the
        bench widens the tiny text encoders' outputs to it).
    lora_targets: path prefixes, inside a repeated block, of the linear layers the bench's random
        LoRA writes (`--scenarios lora`).
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
    reference_size: Callable[[int, int], tuple[int, int]] | None = None
    call_kwargs: dict[str, Any] = field(default_factory=lambda: {"max_sequence_length": 512})
    min_steps: int = 1
    tokenizer: str | None = None
    truncates: bool = True
    text_rule: str = "padded"
    text_input: str = "encoder_hidden_states"
    text_extra: int = 0
    sequence_multiple: int = 1
    requires: tuple[str, ...] = ()
    controls: tuple[str, ...] = ()
    layer_fields: tuple[str, ...] = ("num_layers", "num_single_layers")
    head_fields: tuple[str, ...] = ("num_attention_heads",)
    width_field: str | None = None
    text_widths: dict[str, str] = field(default_factory=lambda: {"encoder_hidden_states": "joint_attention_dim"})
    lora_targets: tuple[str, ...] = _FLUX_LORA_TARGETS

    @property
    def text_tokens(self) -> int:
        """The longest text the blocks take (`max_sequence_length`); with "padded", every text's length."""
        return self.call_kwargs["max_sequence_length"]

    @property
    def text_range(self) -> tuple[int, int] | None:
        """(min, max) text tokens L of a "prompt" family's dynamic text dimension; None when padded."""
        if self.text_rule != "prompt":
            return None
        return self.padded(MIN_TEXT_TOKENS), self.padded(self.text_tokens + self.text_extra)

    def padded(self, tokens: int) -> int:
        """`tokens` rounded up to the transformer's `sequence_multiple`."""
        return -(-tokens // self.sequence_multiple) * self.sequence_multiple

    @property
    def images(self) -> tuple[int, int]:
        """(fewest, most) images in the transformer's sequence: the output, and a same-sized reference."""
        return {"none": (1, 1), "required": (2, 2), "optional": (1, 2)}[self.image_input]

    def image_tokens(self, resolution: Resolution, height: int, width: int, references: int = 0) -> int:
        """I, the image tokens the blocks see, for an output of `height` x `width` pixels and
        `references` input images (each of `reference_size`)."""
        reference = self.reference_size(height, width) if self.reference_size else (height, width)
        return self.padded(resolution.tokens(height, width) + references * resolution.tokens(*reference))

    def image_range(self, resolution: Resolution) -> tuple[int, int]:
        """(min, max) of I over every output size `resolution` allows (and a reference where one may be given).

        Without `reference_size` the ends are the smallest and largest square; with it every allowed
        size is tried (a few thousand, microseconds each).
        """
        (fewest, most), (lo, hi) = self.images, (resolution.min_side, resolution.max_side)
        if self.reference_size is None:
            return self.image_tokens(resolution, lo, lo, fewest - 1), self.image_tokens(resolution, hi, hi, most - 1)
        sides = range(lo, hi + 1, resolution.step)
        sizes = [(h, w) for h in sides for w in sides]
        return (
            min(self.image_tokens(resolution, h, w, fewest - 1) for h, w in sizes),
            max(self.image_tokens(resolution, h, w, most - 1) for h, w in sizes),
        )

    @property
    def capture_references(self) -> int:
        """Input images in a capture call (`capture_call` without `reference`): one where one is required."""
        return self.images[0] - 1

    def captures(
        self, sizes: list[tuple[int, int]], prompt: str, long_prompt: str
    ) -> list[tuple[tuple[int, int], str]]:
        """(size, prompt) of each capture call a compile needs: `prompt` at every size of `sizes`,
        then, where the text length follows the prompt, `long_prompt` at the first size (a capture
        that differs in text tokens only: L is a dynamic dimension, `contract.contract_from_captures`)."""
        calls = [(size, prompt) for size in sizes]
        if self.text_rule == "prompt":
            calls.append((sizes[0], long_prompt))
        return calls

    def text_tokens_of(self, transformer_kwargs: dict[str, Any]) -> int:
        """L, the text tokens the blocks see, from one transformer call's keyword arguments.

        Raises:
            ValueError: the call has no tensor under `text_input`.
        """
        leaves = [t for t in pytree.tree_leaves(transformer_kwargs.get(self.text_input)) if isinstance(t, torch.Tensor)]
        if not leaves:
            raise ValueError(f"{self.label}: the transformer call has no tensor argument {self.text_input!r}")
        return self.padded(leaves[0].shape[-2])

    def missing(self) -> list[str]:
        """The modules of `requires` that cannot be imported here."""
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

    def call(self, pipe: Any, request: Any) -> dict[str, Any]:
        """The keyword arguments of one pipeline call for `request` (all by keyword: edit pipelines
        take `image` first). `request` has app.py's `Request` fields: prompt, height, width,
        num_inference_steps, guidance_scale, image, and those this row's `controls` name, each
        passed on under its own name unless empty (the row's `call_kwargs` value stays then).

        `request.image` (a PIL image) goes in at width x height, so its tokens follow the output's:
        as it is where it has that size (`server.Server.prepare` fitted it), else fitted here
        (`images.fit`: cropped to the output's aspect ratio, never stretched).

        Raises:
            ValueError: an edit family without an image, or an image for a text-to-image family.
        """
        height, width, image = request.height, request.width, request.image
        kwargs = {"prompt": request.prompt, "height": height, "width": width, **self.call_kwargs}
        kwargs["num_inference_steps"] = request.num_inference_steps
        kwargs.update({name: v for name, v in controls_sent(request).items() if name in self.controls})
        if self.guided(pipe):
            kwargs[self.guidance_kwarg] = request.guidance_scale
        if self.image_input == "required" or (self.image_input == "optional" and image is not None):
            if image is None:
                raise ValueError(f"{self.label} ({self.pipeline}) edits an image: give an input image")
            if image.size != (width, height) or image.mode != "RGB":
                image = images.fit(images.to_rgb(image), width, height)[0]
            kwargs["image"] = image
            kwargs.update({k: v(height, width) if callable(v) else v for k, v in self.reference_kwargs.items()})
        elif image is not None:
            raise ValueError(f"{self.label} ({self.pipeline}) generates from text only: it takes no input image")
        return kwargs

    def capture_call(
        self, pipe: Any, prompt: str, height: int, width: int, steps: int | None = None, reference: bool = False
    ) -> dict[str, Any]:
        """The keyword arguments of a capture or benchmark call (`call` with the family's default
        guidance and `min_steps` unless `steps` is given). A fixed input image of the output
        size goes in where one is required, or asked for with `reference` where it is optional; an
        optional image is captured without one (`image_range` covers both).

        Raises:
            ValueError: `reference` for a text-to-image family.
        """
        if reference and self.image_input == "none":
            raise ValueError(f"{self.label} ({self.pipeline}) takes no input image")
        image = None
        if self.image_input == "required" or reference:
            pixels = torch.arange(height * width * 3, dtype=torch.int64).reshape(height, width, 3) % 251
            image = Image.fromarray(pixels.to(torch.uint8).numpy())
        steps = self.min_steps if steps is None else steps
        request = CaptureRequest(prompt, height, width, steps, self.defaults(pipe)[1], image)
        return self.call(pipe, request)


@dataclass(frozen=True)
class CaptureRequest:
    """The request a capture or benchmark call stands for (`Family.capture_call`): the fields every
    family reads; a family's `controls` keep their `call_kwargs` defaults."""

    prompt: str
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    image: Any = None


def _qwen_edit_reference(height: int, width: int) -> tuple[int, int]:
    """(height, width) QwenImageEditPipeline resizes its input image to: about 1 MP, the output's aspect ratio."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import (  # heavy: at first use
        calculate_dimensions,
    )

    ref_width, ref_height, _ = calculate_dimensions(1024 * 1024, width / height)
    return ref_height, ref_width


# The fewest text tokens a "prompt" family's blocks accept: torch.export specializes a dimension
# of size 0 or 1. Qwen-Image's prompt template leaves at least 5 tokens after its system prompt.
MIN_TEXT_TOKENS = 2
_FLUX_GUIDED = ("transformer", "guidance_embeds", True)
_FLUX_TEXT = {"encoder_hidden_states": "joint_attention_dim", "pooled_projections": "pooled_projection_dim"}
FAMILIES: dict[str, Family] = {
    f.pipeline: f
    for f in (
        # FLUX.1 dev (guidance-distilled: embedded guidance) and schnell (timestep-distilled: none).
        Family(
            "FluxPipeline",
            "FLUX.1",
            "guidance_scale",
            28,
            3.5,
            guided_when=_FLUX_GUIDED,
            tokenizer="tokenizer_2",
            text_widths=_FLUX_TEXT,
        ),
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
            text_widths=_FLUX_TEXT,
        ),
        # Chroma: true classifier-free guidance (a second call with the negative prompt, same shapes).
        Family(
            "ChromaPipeline", "Chroma", "guidance_scale", 28, 4.0, tokenizer="tokenizer", controls=("negative_prompt",)
        ),
        # FLUX.2 klein: step-distilled checkpoints set is_distilled and ignore guidance. FLUX.2 takes
        # an optional reference image (the pipeline shrinks one above 1 MP to 1 MP: still in range).
        Family(
            "Flux2KleinPipeline",
            "FLUX.2 klein",
            "guidance_scale",
            50,
            4.0,
            guided_when=("pipeline", "is_distilled", False),
            image_input="optional",
        ),
        Family("Flux2Pipeline", "FLUX.2", "guidance_scale", 50, 4.0, image_input="optional", requires=("torchvision",)),
        # Qwen-Image: true classifier-free guidance against a negative prompt (its own text length);
        # one-step calls give NaN timesteps with its scheduler, so captures run two steps.
        Family(
            "QwenImagePipeline",
            "Qwen-Image",
            "true_cfg_scale",
            50,
            4.0,
            call_kwargs={"max_sequence_length": 512, "negative_prompt": " "},
            min_steps=2,
            tokenizer="tokenizer",
            text_rule="prompt",
            controls=("negative_prompt",),
            layer_fields=("num_layers",),
        ),
        # Qwen-Image-Edit: the text encoder reads the prompt with the reference image (its vision
        # tokens join the text, which is not cut at max_sequence_length: a longer prompt is refused).
        Family(
            "QwenImageEditPipeline",
            "Qwen-Image-Edit",
            "true_cfg_scale",
            50,
            4.0,
            image_input="required",
            reference_size=_qwen_edit_reference,
            call_kwargs={"max_sequence_length": 512, "negative_prompt": " "},
            min_steps=2,
            tokenizer="tokenizer",
            truncates=False,
            text_rule="prompt",
            text_extra=2048,
            requires=("torchvision",),
            layer_fields=("num_layers",),
        ),
        # Z-Image-Turbo: 8 DiT steps (9 scheduler steps), no guidance. Guidance > 0 (the base model's
        # CFG) runs the prompt and the negative prompt as a batch of two with a mask: other inputs.
        Family(
            "ZImagePipeline",
            "Z-Image",
            None,
            9,
            0.0,
            unguided_steps=9,
            call_kwargs={"max_sequence_length": 512, "guidance_scale": 0.0},
            tokenizer="tokenizer",
            text_rule="prompt",
            text_input="cap_feats",
            sequence_multiple=32,
            layer_fields=("n_layers", "n_refiner_layers"),
            head_fields=("n_heads", "n_kv_heads"),
            width_field="dim",
            text_widths={"cap_feats": "cap_feat_dim"},
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
    "QwenImageEditPlusPipeline": "it takes several input images, each resized on its own (not built yet)",
}

# Every `Request` field some family's pipeline takes beyond the common ones (`Family.controls`).
CONTROLS: tuple[str, ...] = tuple(sorted({name for row in FAMILIES.values() for name in row.controls}))


def controls_sent(request: Any) -> dict[str, Any]:
    """The `CONTROLS` fields `request` fills in (neither None nor ""), by name: a family that takes
    one gets it as a call argument (`Family.call`); for one that does not, notes say it was unused."""
    return {name: value for name in CONTROLS if (value := getattr(request, name, None)) not in (None, "")}


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


def graph_safe_(transformer: torch.nn.Module) -> list[str]:
    """Remove, in place, what in a model's own step keeps it from running as a CUDA graph, without
    changing what it computes; returns the paths of the modules changed.

    A capture refuses a copy from host memory that is not pinned (and a pinned one would be read
    again at every replay, from wherever that memory then is). Chroma's time embedding makes
    `torch.tensor([0] * batch)` on the host at every step and copies its `Timesteps` projection to
    the GPU (diffusers 0.42.1, `ChromaCombinedTimestepTextProjEmbeddings.forward`); here those zeros
    are made on the module's own device instead. No other family's step copies from the host after
    its first step (tests/test_host_copies.py checks every tiny family)."""
    changed = []
    for path, module in transformer.named_modules():
        if type(module).__name__ == "ChromaCombinedTimestepTextProjEmbeddings":
            if not isinstance(module.guidance_proj, _ZerosOnDevice):
                module.guidance_proj = _ZerosOnDevice(module.guidance_proj, module.mod_proj.device)
            changed.append(f"{path}.guidance_proj")
    return changed


class _ZerosOnDevice(torch.nn.Module):
    """`proj` (a weightless module such as diffusers' `Timesteps`) whose all-zero host input is made
    on the device instead: the same values, no host-to-device copy. Any other input goes to `proj`
    as it is. The empty `anchor` buffer moves with the model and says where the device is."""

    def __init__(self, proj: torch.nn.Module, device: torch.device):
        super().__init__()
        self.proj = proj
        # `.to(device)`, not `device=`: in a ZeroGPU main process only `.to` makes an (emulated) CUDA tensor
        self.register_buffer("anchor", torch.empty(0).to(device), persistent=False)

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        if timesteps.device.type == "cpu" and not timesteps.any():  # a host tensor: no GPU sync to read it
            timesteps = torch.zeros(timesteps.shape, dtype=timesteps.dtype, device=self.anchor.device)
        return self.proj(timesteps)

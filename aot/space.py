"""Serving one pipeline: the engine behind app.py's request, its bounds, its GPU call and its notes.

`Space.start(options)` loads the pipeline (one replica per GPU), compiles or loads its packages,
and works out once what every request needs: the family's row, the side range, the defaults, the
LoRAs offered. `Space.generate(request)` checks a request, runs it on a replica (on ZeroGPU, in a
GPU worker) and says what was generated. A request is any object with the fields of app.py's
`Request`: the family's row names the extra ones its pipeline takes (`families.Family.controls`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import tempfile
import time
import typing
import warnings
from typing import Any

import gradio as gr
import torch
from gradio.utils import get_upload_folder
from PIL import Image

from aot import replicas, zerogpu
from aot.families import controls_sent
from aot.options import Options

log = logging.getLogger("app")

MAX_SEED = 2**31 - 1
MAX_STEPS = 50
MAX_GUIDANCE = 10.0
# Untrusted sizes, bounded before any work. A prompt: every family's text encoders read at most 512
# tokens (about 2,500 characters of English), so 10,000 characters loses nothing; a far longer one
# only costs tokenizing time (BENCHMARKS.md). An input image is resized to the output (at most 1536 px
# a side), so a 50 MB, 64-megapixel upload is more than any camera sends.
MAX_PROMPT_CHARS = 10_000
MAX_IMAGE_BYTES = 50_000_000
MAX_IMAGE_PIXELS = 64_000_000
# ZeroGPU gives each request `duration` seconds of GPU and refuses a request that asks for more than
# its cap (C28). The main process cannot know whether the request will find a worker alive, so every
# request asks for a new worker's setup too. Each constant is 3 x a time measured on the H200 (for
# ZeroGPU's card, not measurable here, and for slack; BENCHMARKS.md): a compiled new worker's first
# request, the slowest LoRA switch (lora.Adapters.use), an eager step at 4096 image tokens.
NEW_WORKER_SECONDS = 3 * 16.0
LORA_SWITCH_SECONDS = 3 * 0.6
SECONDS_PER_STEP_AT_4096_TOKENS = 3 * 0.175
MAX_GPU_SECONDS = 120


def refuse(message: str) -> gr.Error:
    """The error for a refused request: the client sees `message`, the server log one line."""
    log.info("refused a request: %s", message)
    return gr.Error(message, print_exception=False)


def named(component: gr.components.Component, allowed: str) -> gr.components.Component:
    """`component`, whose refused inputs say its name and what is `allowed` in one line: gradio's own
    say only "Value 4096 is greater than maximum value 1536.", wrap anything else (a string or NaN
    for a slider, a file that is not an image) in a message that shows server paths, and print a
    traceback in the server log for each refused request. An input image is bounded in bytes and
    pixels before it is decoded.

    (An instance attribute: a subclass of a gradio component makes gradio write a `.pyi` beside us.)
    """
    check = component.preprocess

    def preprocess(payload: Any) -> Any:
        what = f"{component.label}: {_shown(payload, component)}"
        problem = _image_problem(payload) if isinstance(component, gr.Image) else None
        if problem:
            raise refuse(f"{what} {problem}; use {allowed}.")
        try:
            value = check(payload)
        except gr.Error as exc:
            raise refuse(f"{component.label}: {exc.message} Use {allowed}.") from None
        except Exception as exc:  # what gradio's conversion or PIL raised for a value it cannot take
            raise refuse(f"{what} cannot be used ({type(exc).__name__}); use {allowed}.") from None
        if isinstance(component, gr.Slider) and not _finite_number(value):
            raise refuse(f"{what} cannot be used; use {allowed}.")
        return value

    component.preprocess = preprocess
    return component


def _shown(payload: Any, component: gr.components.Component) -> str:
    """How a refused value is quoted: an upload by its kind, never its path on this server."""
    if isinstance(component, gr.Image):
        return "the uploaded file"
    text = repr(payload)
    return text if len(text) <= 40 else text[:37] + "..."


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _image_problem(payload: Any) -> str | None:
    """What makes an upload too large (over `MAX_IMAGE_BYTES` or `MAX_IMAGE_PIXELS`), read before it is
    decoded (PIL reads the size from the header: a decompression bomb is refused, not decoded)."""
    path = payload.path if hasattr(payload, "path") else payload.get("path") if isinstance(payload, dict) else None
    if not isinstance(path, str) or not os.path.isfile(path):
        return None  # nothing uploaded, or what gradio's own preprocess refuses
    if os.path.getsize(path) > MAX_IMAGE_BYTES:
        return f"has {os.path.getsize(path) / 1e6:.0f} MB"
    try:
        with warnings.catch_warnings(), Image.open(path) as image:
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the bound below says it
            pixels = image.width * image.height
    except Exception:
        return None  # not an image at all: gradio's preprocess fails on it, and says so below
    return f"has {pixels / 1e6:.0f} megapixels" if pixels > MAX_IMAGE_PIXELS else None


class Space:
    """One model served: its replicas (`replicas.Replicas`) and the facts every request needs,
    worked out once at `start`.

    family: the pipeline's row (families.py); resolution: the side range (`options.Resolution`);
    guided: whether the model takes guidance; default_steps, default_guidance: the UI's defaults;
    steps_allowed: the steps a request may ask for, in words (from the family's `min_steps` to `MAX_STEPS`);
    loras: what a request may pick ("none" first); status: one line on what was compiled and how.
    """

    def __init__(self, options: Options, served: replicas.Replicas):
        self.options, self.replicas = options, served
        pipe, target = served.pipes[0], served.targets[0]  # the model's facts are the same for every replica
        self.family, self.resolution = target.family, target.resolution
        self.guided = self.family.guided(pipe)
        self.default_steps, self.default_guidance = self.family.defaults(pipe)
        self.steps_allowed = f"a whole number from {self.family.min_steps} to {MAX_STEPS}" + (
            f" ({self.family.label}'s scheduler gives a NaN image for fewer)" if self.family.min_steps > 1 else ""
        )
        self.edits = self.family.image_input == "required"  # an input image must be given; "optional": it may be
        # Counts a prompt's tokens for the truncation note (None: the family names no tokenizer, no note).
        self.tokenizer = getattr(pipe, self.family.tokenizer) if self.family.tokenizer else None
        self.loras = ["none", *served.adapters[0].names]  # what a request can pick (AOT_LORA_CHOICES)
        if options.compile:
            report = served.reports[0]
            log.info("compiled blocks:\n%s", report)
            self.status = report.summary() + (f"; {len(served)} replicas" if len(served) > 1 else "")
        else:
            self.status = "eager pipeline (compile switched off: AOT_COMPILE=0 / --no-compile)"
        zerogpu.check_size(pipe, options.gpu_size)  # what a new ZeroGPU worker moves; warns where it will not fit
        self._infer = zerogpu.gpu(self.infer, duration=self.gpu_seconds, size=options.gpu_size)

    @classmethod
    def start(cls, options: Options, pipe: Any = None) -> Space:
        """Load `options.model` (or take `pipe`, already loaded), compile or load its packages, and
        apply them (`replicas.start`).

        Raises:
            RuntimeError, ValueError, OSError: a setting that cannot work (see `replicas.start`).
        """
        started = time.perf_counter()
        space = cls(options, replicas.start(options, pipe))
        log.info("%s; startup took %.1f s", space.status, time.perf_counter() - started)
        return space

    def check(self, request: Any) -> None:
        """Raise `gr.Error` saying what is allowed, before any GPU work.

        Gradio's sliders already refuse values that are not numbers or outside their range (`named`);
        this also covers text that is not text or too long (every `str` field of the request), a
        prompt with nothing to read, sizes that are not multiples of 16, fractional values, a missing
        input image for an edit model (or one for a text-to-image model), and direct calls.
        """
        hints = typing.get_type_hints(type(request))
        for f in dataclasses.fields(request):
            if hints.get(f.name) is str:
                _check_text(f.name, getattr(request, f.name))
        if not any(ch.isprintable() and not ch.isspace() for ch in request.prompt):
            raise refuse("Enter a prompt (it has no visible character).")
        label, image = self.family.label, request.image
        if self.edits and image is None:
            raise refuse(f"Upload an input image: {label} edits an image (it is resized to the output size).")
        if self.family.image_input == "none" and image is not None:
            raise refuse(f"{label} generates from text only: leave the input image empty.")
        numbers = {"width": request.width, "height": request.height, "steps": request.num_inference_steps}
        numbers.update(seed=request.seed, guidance=request.guidance_scale)
        for name, value in numbers.items():
            if not _finite_number(value):
                raise refuse(f"{name}={_shown(value, None)}: use a number.")
            if name != "guidance" and value != int(value):
                raise refuse(f"{name}={value}: use a whole number.")
        if not isinstance(request.randomize_seed, bool):
            raise refuse(f"randomize_seed={_shown(request.randomize_seed, None)}: use true or false.")
        try:
            self.resolution.check(int(request.height), int(request.width))
        except ValueError as exc:
            raise refuse(str(exc)) from None
        if not self.family.min_steps <= request.num_inference_steps <= MAX_STEPS:
            raise refuse(f"steps={request.num_inference_steps}: use {self.steps_allowed}.")
        if not 0.0 <= request.guidance_scale <= MAX_GUIDANCE:
            raise refuse(f"guidance={request.guidance_scale}: use a value from 0 to {MAX_GUIDANCE}.")
        if not 0 <= request.seed <= MAX_SEED:
            raise refuse(f"seed={request.seed}: use a whole number from 0 to {MAX_SEED}.")
        if request.lora not in self.loras:
            allowed = ", ".join(self.loras)
            raise refuse(f"lora={request.lora!r}: use one of {allowed} (AOT_LORA_CHOICES lists what is offered).")
        text_tokens = self.family.text_tokens  # the text length the blocks are compiled for
        if not self.family.truncates and (tokens := self.prompt_tokens(request.prompt)) > text_tokens:
            raise refuse(
                f"The prompt has {tokens} text tokens; {label} takes at most {text_tokens} "
                "(its pipeline does not cut a longer one, and the blocks are compiled for that length)."
            )

    def prompt_tokens(self, prompt: str) -> int:
        """The prompt's length in the family's tokenizer (0 where the family names none)."""
        return len(self.tokenizer(prompt).input_ids) if self.tokenizer is not None else 0

    def gpu_seconds(self, replica: int, request: Any, seed: int) -> int:
        """ZeroGPU duration for one request, in seconds: a new worker's setup + a LoRA switch + the
        steps, the per-step time scaled by the image tokens the blocks see (the output's, plus an
        input image's: `families.Family.image_tokens`); at most `MAX_GPU_SECONDS` (63 s at
        1024x1024, 28 steps). Takes `infer`'s arguments, as spaces calls it."""
        height, width = int(request.height), int(request.width)
        tokens = self.family.image_tokens(self.resolution, height, width, references=int(request.image is not None))
        steps_s = request.num_inference_steps * SECONDS_PER_STEP_AT_4096_TOKENS * tokens / 4096
        switch_s = LORA_SWITCH_SECONDS if len(self.loras) > 1 else 0
        return min(MAX_GPU_SECONDS, math.ceil(NEW_WORKER_SECONDS + switch_s + steps_s))

    def infer(self, replica: int, request: Any, seed: int) -> Image.Image:
        """(On the GPU.) One image from replica number `replica` running the request's LoRA ("none":
        the base weights). On ZeroGPU this runs in a forked worker: the request (small; its input
        image a small PIL image) is pickled, the pipelines reach it through fork (this object),
        never as arguments; so do their LoRAs, written into the worker's weights in place."""
        pipe = self.replicas.pipes[replica]
        self.replicas.adapters[replica].use(None if request.lora == "none" else request.lora)
        generator = torch.Generator(device=pipe.device).manual_seed(seed)
        return pipe(**self.family.call(pipe, request), generator=generator).images[0]

    def generate(self, request: Any) -> tuple[Image.Image, int, str]:
        """One image for `request`; returns (PIL image, seed used, notes). Invalid input raises `gr.Error`.

        notes says what was generated (size, steps, seed: the UI's sliders round a typed value to
        their step without a word) and what the request did not get as asked (a prompt cut to the
        text length the blocks are compiled for), so that API clients learn it too, not only the UI.
        """
        self.check(request)
        seed = random.randint(0, MAX_SEED) if request.randomize_seed else int(request.seed)
        width, height, steps = int(request.width), int(request.height), int(request.num_inference_steps)
        request = dataclasses.replace(request, width=width, height=height, num_inference_steps=steps)
        notes = f"{width}x{height} px, {steps} step{'s' * (steps != 1)}, seed {seed}."
        if request.lora != "none":
            notes += f" LoRA: {request.lora}."
        if not self.guided and request.guidance_scale != self.default_guidance:
            notes += f" Guidance {request.guidance_scale:g} was not used: this {self.family.label} model takes none."
        for name in controls_sent(request):  # sent to a pipeline that takes none (its widget is hidden: API clients)
            if name not in self.family.controls:
                notes += f" The {name.replace('_', ' ')} was not used: this {self.family.label} model takes none."
        if (image := request.image) is not None:
            notes += f" The input image ({image.width}x{image.height}) was resized to {width}x{height}"
            if self.family.reference_size:
                notes += ", then by the pipeline to {1}x{0}".format(*self.family.reference_size(height, width))
            notes += "."
        if self.family.truncates and self.prompt_tokens(request.prompt) > self.family.text_tokens:
            cut = f"The prompt is longer than {self.family.text_tokens} text tokens; the rest was ignored."
            gr.Warning(cut)
            notes += " " + cut
        with self.replicas.take() as replica:
            start = time.perf_counter()
            log.info("replica %d started a request", replica)
            output = self._infer(replica, request, seed)
            took = time.perf_counter() - start
            log.info("replica %d served %sx%s, %s steps in %.1f s", replica, width, height, steps, took)
        return output, seed, notes


def image_file(image: Image.Image, seed: int) -> str:
    """`image` written as a PNG file of its own in gradio's cache folder; returns its path, which
    gradio serves as it is (no copy) and keeps like its own outputs (`gr.Blocks(delete_cache=...)`
    removes old ones). The file name says the seed (what a download is saved as):
    `seed-7-<random>.png`. A write that fails (a full disk) raises and leaves no file.

    Why not return the PIL image: gradio (6.31.0) saves an output image to
    `<cache>/<hash of its PNG bytes>/image.png`, truncating and rewriting that file. Two requests
    that make the same image at once (same prompt and seed: an example clicked twice) share the
    file, and one rewrites it while the other is downloading it: that client got 589,824 of 892,769
    bytes, "peer closed connection without sending complete message body" (CI of a530eed).
    """
    folder = get_upload_folder()  # where gradio keeps what it serves: GRADIO_TEMP_DIR, or /tmp/gradio
    os.makedirs(folder, exist_ok=True)
    handle, path = tempfile.mkstemp(dir=folder, prefix=f"seed-{seed}-", suffix=".png")
    try:
        with os.fdopen(handle, "wb") as file:
            image.save(file, format="PNG")
    except BaseException:
        os.unlink(path)
        raise
    return path


def _check_text(name: str, value: Any) -> None:
    """A text field: text, at most `MAX_PROMPT_CHARS` long (checked before tokenizing), valid Unicode."""
    if not isinstance(value, str):
        raise refuse(f"{name}={_shown(value, None)}: send text.")
    if len(value) > MAX_PROMPT_CHARS:
        raise refuse(f"The {name.replace('_', ' ')} has {len(value):,} characters; use at most {MAX_PROMPT_CHARS:,}.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end]
        raise refuse(
            f"The {name.replace('_', ' ')} holds {bad!r}, which is not text (a lone surrogate); send valid Unicode."
        ) from None

"""Serving one pipeline: what app.py's request needs from the engine, worked out once.

`Server(pipes, reports, options, limits)` holds the replicas (one pipeline per GPU) and the facts
every request reads: the family's row, the side range, the loaded model's defaults (`defaults`:
what the widgets start at, what gradio_client and a short raw HTTP call get, what a `Request` field
left at None becomes), the LoRAs offered. For one request: `fill` gives its left-out fields their
defaults, `prepare` checks it (a refusal is one `gr.Error` line: the control's label, what was
wrong, what is allowed) and says in its notes what will be generated, `infer` runs it on a replica
(on ZeroGPU inside app.py's `@spaces.GPU` function, in a worker).

A request is any dataclass with the fields of app.py's `Request`: the family's row names the extra
ones its pipeline takes (`families.Family.controls`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import os
import random
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr
import torch
from PIL import Image

from aot import cancel, images, lora
from aot.blocks import tensor_bytes
from aot.compiled import Report
from aot.families import controls_sent
from aot.options import Options
from aot.replicas import Replicas
from aot.results import Results
from aot.target import Target
from aot.zerogpu_limits import ON_ZEROGPU, size_advice

log = logging.getLogger("app")

# A prompt: every family's text encoders read at most 512 tokens (about 2,500 characters of
# English), so 10,000 characters loses nothing; a far longer one only costs tokenizing time.
MAX_PROMPT_CHARS = 10_000


@dataclass(frozen=True)
class Limits:
    """What a request may ask for beyond the side range (app.py's constants): at most `max_steps`
    denoising steps (at least the family's `min_steps`), guidance 0..`max_guidance`, seeds
    0..`max_seed`."""

    max_steps: int
    max_guidance: float
    max_seed: int


def refuse(label: str, problem: str, allowed: str) -> gr.Error:
    """The error for a refused request, in the one form every refusal takes:
    `"<label>: <problem>; <allowed>."` (`"Width: 2048 is above 1536; use a multiple of 16 from 512
    to 1536 px."`). The client sees it; the server log gets one line, no traceback."""
    message = f"{label}: {problem}; {allowed}."
    log.info("refused a request: %s", message)
    return gr.Error(message, print_exception=False)


def guard(component: gr.components.Component, allowed: str, before: Any = None) -> gr.components.Component:
    """`component`, whose refused inputs say its label, what was wrong and what is `allowed` (e.g.
    "use a multiple of 16 from 512 to 1536 px") in one line (`refuse`), checked before gradio's own
    conversion: gradio's say "Value 4096 is greater than maximum value 1536." or "Value: ghibli is
    not in the list of choices", wrap anything else in a message that lists its components or shows
    server paths, and print a traceback for each. A slider takes finite numbers within its range
    (whole numbers where its `precision` is 0, on its grid where its `step` is a whole number); a
    dropdown one of its choices; an image an upload that `images.upload_problem` passes, after
    `before(payload)` (a callable returning a refusal's problem and allowed text, or None: the
    family's own rule, e.g. a text-to-image model takes no image at all).

    (An instance attribute: a subclass of a gradio component makes gradio write a `.pyi` beside us.)
    """
    convert, label = component.preprocess, component.label

    def preprocess(payload: Any) -> Any:
        if isinstance(component, gr.Image):
            refused = before(payload) if before and payload is not None else None
            if refused:
                raise refuse(label, *refused)
            path = _upload_path(payload)
            problem = images.upload_problem(path) if path else None
            if problem:
                raise refuse(label, f"the uploaded file {problem}", f"use {allowed}")
        elif isinstance(component, gr.Slider):
            problem = number_problem(
                payload, component.minimum, component.maximum, component.precision == 0, component.step
            )
            if problem:
                raise refuse(label, f"{_shown(payload)} {problem}", f"use {allowed}")
        elif isinstance(component, gr.Dropdown):
            if payload not in [value for _, value in component.choices]:
                raise refuse(label, f"{_shown(payload)} is not offered", f"use {allowed}")
        try:
            return convert(payload)
        except Exception as exc:  # what gradio's conversion or PIL raised for a value it cannot take
            what = "the uploaded file" if isinstance(component, gr.Image) else _shown(payload)
            raise refuse(label, f"{what} cannot be read ({type(exc).__name__})", f"use {allowed}") from None

    component.preprocess = preprocess
    return component


def _number(x: float) -> str:
    """`x` as a refusal writes it: whole numbers in full (2147483647, not 2.14748e+09), others as `:g`."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def number_problem(value: Any, low: float, high: float, whole: bool, step: float = 1) -> str | None:
    """Why `value` is not a number from `low` to `high` (a whole one where `whole`, on the grid of
    whole `step`s from `low`), or None: the one rule of the widgets (`guard`) and `Server.check_request`."""
    if not _finite_number(value):
        return "is not a number"
    if whole and value != int(value):
        return "is not a whole number"
    if value < low:
        return f"is below {_number(low)}"
    if value > high:
        return f"is above {_number(high)}"
    if float(step).is_integer() and step > 1 and (value - low) % step:
        return f"is not a multiple of {step:g}"
    return None


def _upload_path(payload: Any) -> str | None:
    """The server path of an uploaded file's payload, where there is one."""
    path = payload.path if hasattr(payload, "path") else payload.get("path") if isinstance(payload, dict) else None
    return path if isinstance(path, str) and os.path.isfile(path) else None


def _shown(value: Any) -> str:
    """How a refused value is quoted (at most 40 characters)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# How refusals name a request's fields where no widget says it (`Server.labels`, filled by `guard`).
LABELS = {"num_inference_steps": "Steps", "guidance_scale": "Guidance", "lora": "LoRA", "image": "Input image"}


class Server:
    """One model served: its replicas and the facts every request needs, worked out once.

    family: the pipeline's row (families.py); resolution: the side range (`resolution.Resolution`);
    limits: app.py's (`Limits`); guided: whether the model takes guidance; defaults: every request
    field's default for this model (`fill`); steps_allowed: the steps a request may ask for, in words;
    edits: an input image is required; loras: what a request may pick ("none" first); status: one
    line on what was compiled and how; labels: each request field's label in refusals.
    results: where each request's image is written (`results.Results`: earlier runs' are deleted now).
    `gpu_size`: app.py's ZeroGPU card size, for the startup line on what a new worker moves.
    """

    def __init__(
        self,
        pipes: list[Any],
        reports: list[Report | None],
        options: Options,
        limits: Limits,
        gpu_size: str | None = None,
    ):
        self.options, self.limits, self.reports = options, limits, reports
        pipe = pipes[0]  # the model's facts are the same for every replica
        target = Target.of(pipe, options)
        self.family, self.resolution = target.family, target.resolution
        self.guided = self.family.guided(pipe)
        steps, guidance = self.family.defaults(pipe)
        side = min(max(1024, self.resolution.min_side), self.resolution.max_side)
        self.defaults: dict[str, Any] = {
            "seed": 0,
            "randomize_seed": True,
            "width": side,
            "height": side,
            "num_inference_steps": steps,
            "guidance_scale": guidance,
            "lora": "none",
            "image": None,
            "negative_prompt": "",
        }
        self.steps_allowed = f"a whole number from {self.family.min_steps} to {limits.max_steps}" + (
            f" ({self.family.label}'s scheduler gives a NaN image for fewer)" if self.family.min_steps > 1 else ""
        )
        self.edits = self.family.image_input == "required"  # an input image must be given; "optional": it may be
        # Counts a prompt's tokens for the truncation note (None: the family names no tokenizer, no note).
        self.tokenizer = getattr(pipe, self.family.tokenizer) if self.family.tokenizer else None
        if self.family.truncates:  # the request's notes say a prompt was cut; the pipeline's log need not
            logging.getLogger(type(pipe).__module__).addFilter(drop_truncation_warnings)
        fp8 = [report.compiled.fp8_config if report else None for report in reports]
        first = lora.Adapters(pipe, list(target.choices), fp8[0])  # the LoRAs are read once
        adapters = [first, *(first.for_pipeline(p, f) for p, f in zip(pipes[1:], fp8[1:], strict=True))]
        self.replicas = Replicas(pipes, adapters)
        self.loras = ["none", *first.names]  # what a request can pick (AOT_LORA_CHOICES)
        self.labels = dict(LABELS)
        self.results = Results(options.results_max_age)
        if options.compile:
            self.status = reports[0].summary() + (f"; {len(pipes)} replicas" if len(pipes) > 1 else "")
        else:
            self.status = "eager pipeline (compile switched off: AOT_COMPILE=0 / --no-compile)"
        if ON_ZEROGPU:  # what a new worker moves; warns where it will not fit
            line, warn = size_advice(weight_bytes(pipe), gpu_size)
            (log.warning if warn else log.info)("%s", line)

    def guard(self, name: str, component: gr.components.Component, allowed: str) -> gr.components.Component:
        """`guard(component, allowed)` for the widget of request field `name`, whose label the
        server's own refusals of that field then use. An image widget first refuses an upload the
        family cannot take (a text-to-image model takes none)."""
        self.labels[name] = component.label
        before = None
        if isinstance(component, gr.Image) and self.family.image_input == "none":
            before = lambda _: (f"{self.family.label} generates from text only", "leave it empty")  # noqa: E731
        return guard(component, allowed, before)

    def label(self, name: str) -> str:
        """How refusals name request field `name`: its widget's label, else its name, capitalized."""
        return self.labels.get(name) or name.replace("_", " ").capitalize()

    def fill(self, request: Any) -> Any:
        """`request` with every field left at None given this model's default (`defaults`; a field
        it has none for stays None)."""
        fields = dataclasses.fields(request)
        missing = {f.name: self.defaults.get(f.name) for f in fields if getattr(request, f.name) is None}
        return dataclasses.replace(request, **missing)

    def image_tokens(self, request: Any) -> int:
        """The image tokens the blocks see for `request` (filled and prepared): the output's, plus
        an input image's (`families.Family.image_tokens`)."""
        references = int(request.image is not None)
        return self.family.image_tokens(self.resolution, int(request.height), int(request.width), references)

    def check_request(self, request: Any) -> None:
        """Raise `gr.Error` (`refuse`) unless `request` (filled) is one this model can serve.

        The widgets refuse what they can (`guard`); this covers every request, direct calls
        included: text that is not text or too long (every `str` field), a prompt with nothing to
        read, numbers that are not numbers, whole or in range, sides off the pixel grid, an
        unoffered LoRA, an input image missing for an edit model (or given to a text-to-image one),
        and a prompt longer than the blocks take where the pipeline does not cut it.
        """
        hints = typing.get_type_hints(type(request))
        for f in dataclasses.fields(request):
            if hints.get(f.name) is str or hints.get(f.name) == str | None:
                self._check_text(f.name, getattr(request, f.name))
        if not any(ch.isprintable() and not ch.isspace() for ch in request.prompt):
            raise refuse(self.label("prompt"), "it has no visible character", "describe what to generate")
        family, image = self.family, request.image
        if self.edits and image is None:
            raise refuse(self.label("image"), "missing", f"upload the image to edit: {family.label} edits an image")
        if family.image_input == "none" and image is not None:
            raise refuse(self.label("image"), f"{family.label} generates from text only", "leave it empty")
        if image is not None and not isinstance(image, Image.Image):
            raise refuse(self.label("image"), f"{_shown(image)} is not an image", f"send {images.ALLOWED}")
        lo, hi, most = self.resolution.min_side, self.resolution.max_side, self.limits
        guidance = f"a number from 0 to {most.max_guidance:g}"
        step, steps = self.resolution.step, self.steps_allowed
        numbers = {  # value, low, high, whole, grid step, what is allowed
            "width": (request.width, lo, hi, True, step, self.resolution.sides),
            "height": (request.height, lo, hi, True, step, self.resolution.sides),
            "num_inference_steps": (request.num_inference_steps, family.min_steps, most.max_steps, True, 1, steps),
            "seed": (request.seed, 0, most.max_seed, True, 1, f"a whole number from 0 to {most.max_seed}"),
            "guidance_scale": (request.guidance_scale, 0, most.max_guidance, False, 1, guidance),
        }
        for name, (value, low, high, whole, grid, allowed) in numbers.items():
            problem = number_problem(value, low, high, whole, grid)
            if problem:
                raise refuse(self.label(name), f"{_shown(value)} {problem}", f"use {allowed}")
        if not isinstance(request.randomize_seed, bool):
            shown = _shown(request.randomize_seed)
            raise refuse(self.label("randomize_seed"), f"{shown} is not true or false", "use true or false")
        if request.lora not in self.loras:
            allowed = "use one of " + ", ".join(self.loras) + " (AOT_LORA_CHOICES lists what is offered)"
            raise refuse(self.label("lora"), f"{_shown(request.lora)} is not offered", allowed)
        text_tokens = family.text_tokens  # the text length the blocks are compiled for
        if not family.truncates and (tokens := self.prompt_tokens(request.prompt)) > text_tokens:
            raise refuse(
                self.label("prompt"),
                f"it has {tokens} text tokens; {family.label} takes at most {text_tokens} (its pipeline does not "
                "cut a longer one, and the blocks are compiled for that length)",
                "shorten it",
            )

    def _check_text(self, name: str, value: Any) -> None:
        """A text field: text, at most `MAX_PROMPT_CHARS` long (checked before tokenizing), valid Unicode."""
        label = self.label(name)
        if not isinstance(value, str):
            raise refuse(label, f"{_shown(value)} is not text", "send text")
        if len(value) > MAX_PROMPT_CHARS:
            raise refuse(label, f"it has {len(value):,} characters", f"use at most {MAX_PROMPT_CHARS:,}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start : exc.end]
            problem = f"it holds {bad!r}, which is not text (a lone surrogate)"
            raise refuse(label, problem, "send valid Unicode") from None

    def prompt_tokens(self, prompt: str) -> int:
        """The prompt's length in the family's tokenizer (0 where the family names none)."""
        return len(self.tokenizer(prompt).input_ids) if self.tokenizer is not None else 0

    def prepare(self, request: Any) -> tuple[Any, int, str]:
        """Check `request` (filled) and settle what it will generate; returns (request, seed, notes).

        The request that comes back has whole numbers where the model takes them and an input image
        in 8-bit RGB at the output's size (`images.to_rgb`, then `images.fit`: cropped to the
        output's aspect ratio, never stretched). An edit model's output follows the input image's
        aspect ratio where the request's width and height are the defaults (`images.follow_aspect`,
        about as many pixels). The notes say what is generated (size, steps, seed: the UI's sliders
        round a typed value to their step without a word), what became of the input image, and what
        the request did not get as asked (a control this model does not take, a prompt cut to the
        text length the blocks are compiled for), so that API clients learn it too, not only the UI.

        Raises:
            gr.Error: what `check_request` refuses, or an input image whose pixels cannot be read as RGB.
        """
        self.check_request(request)
        seed = random.randint(0, self.limits.max_seed) if request.randomize_seed else int(request.seed)
        width, height, steps = int(request.width), int(request.height), int(request.num_inference_steps)
        changes: dict[str, Any] = {"num_inference_steps": steps}
        notes = []
        if (image := request.image) is not None:
            try:
                rgb = images.to_rgb(image)
            except ValueError as exc:
                raise refuse(self.label("image"), f"the image {exc}", f"send {images.ALLOWED}") from None
            defaults = (self.defaults["width"], self.defaults["height"])
            if self.edits and (width, height) == defaults:
                width, height = self.size_for(rgb)
                notes.append(
                    f"The output follows the input image's aspect ratio (width and height were left at "
                    f"{defaults[0]}x{defaults[1]})."
                )
            changes["image"], done = images.fit(rgb, width, height)
            note = f"The input image ({image.width}x{image.height}) was {done}"
            if self.family.reference_size:
                note += ", then by the pipeline to {1}x{0}".format(*self.family.reference_size(height, width))
            notes.append(note + ".")
        request = dataclasses.replace(request, width=width, height=height, **changes)
        notes.insert(0, f"{width}x{height} px, {steps} step{'s' * (steps != 1)}, seed {seed}.")
        if request.lora != "none":
            notes.insert(1, f"LoRA: {request.lora}.")
        if not self.guided and request.guidance_scale != self.defaults["guidance_scale"]:
            unused = f"Guidance {request.guidance_scale:g} was not used"
            notes.append(f"{unused}: this {self.family.label} model takes none.")
        for name in controls_sent(request):  # sent to a pipeline that takes none (its widget is hidden: API clients)
            if name not in self.family.controls:
                notes.append(f"The {name.replace('_', ' ')} was not used: this {self.family.label} model takes none.")
        if self.family.truncates and self.prompt_tokens(request.prompt) > self.family.text_tokens:
            cut = f"The prompt is longer than {self.family.text_tokens} text tokens; the rest was ignored."
            gr.Warning(cut)
            notes.append(cut)
        return request, seed, " ".join(notes)

    @contextlib.contextmanager
    def replica(self, request: Any) -> Iterator[int]:
        """A free replica for `request` (prepared; `replicas.Replicas.take`): yields its index, and
        logs when it starts and when it has served."""
        with self.replicas.take() as replica:
            start = time.perf_counter()
            log.info("replica %d started a request", replica)
            yield replica
            took = time.perf_counter() - start
            size, steps = f"{request.width}x{request.height}", request.num_inference_steps
            log.info("replica %d served %s, %s steps in %.1f s", replica, size, steps, took)

    def size_for(self, image: Image.Image | None) -> tuple[Any, Any]:
        """(width, height) an edit model's output gets for `image` by default (`prepare`): for the
        UI's sliders to follow an upload; no change without an image."""
        if image is None:
            return gr.update(), gr.update()
        area = self.defaults["width"] * self.defaults["height"]
        step, lo, hi = self.resolution.step, self.resolution.min_side, self.resolution.max_side
        return images.follow_aspect(image.size, area, step, lo, hi)

    def infer(self, replica: int, request: Any, seed: int, stop: int = -1) -> Image.Image:
        """(On the GPU.) One image from replica number `replica` for `request` (prepared) with the
        request's LoRA ("none": the base weights); once stop flag `stop` is raised the pipeline
        skips its remaining steps (`cancel.on_step_end`). On ZeroGPU this runs in a forked worker:
        the request (small; its input image a small PIL image) was pickled, the pipelines reach it
        through fork (this object), never as arguments; so do their LoRAs, written into the
        worker's weights in place."""
        pipe = self.replicas.pipes[replica]
        self.replicas.adapters[replica].use(None if request.lora == "none" else request.lora)
        generator = torch.Generator(device=pipe.device).manual_seed(seed)
        call = self.family.call(pipe, request)
        return pipe(**call, generator=generator, callback_on_step_end=cancel.on_step_end(stop)).images[0]


def weight_bytes(pipe: Any) -> int:
    """Bytes of the weights of `pipe`'s components (`blocks.tensor_bytes`): on ZeroGPU what spaces
    packs at launch and a new worker moves to the GPU before its first call. A quantized weight counts
    its inner tensors (torchao's FP8: one byte a value plus its scales)."""
    return sum(tensor_bytes(c) for c in pipe.components.values() if isinstance(c, torch.nn.Module))


def drop_truncation_warnings(record: logging.LogRecord) -> bool:
    """A logging filter: False for diffusers' "The following part of your input was truncated ..."
    warning, which quotes the cut text of every long prompt (about 6.5 KB a request: 1 MB of log per
    400 requests); `Server.prepare` says in the request's notes that the prompt was cut."""
    return "part of your input was truncated" not in record.getMessage()


def fill_short_calls(demo: gr.Blocks, api_name: str) -> None:
    """Let a call of `demo`'s `/<api_name>` that sends fewer inputs than the endpoint has (a raw
    HTTP call with only the prompt; a client written before the last field was added) get each
    left-out input's widget value, which is also what gradio_client sends for a left-out
    parameter (the API's `parameter_default`). A call with no input at all is refused in one line
    naming the inputs. Gradio itself refuses a short call with a message that lists its components
    and quotes the inputs received (server paths of uploads among them).

    (`Blocks.validate_inputs`, gradio 6.31, patched on this instance: it receives the list of
    inputs that preprocessing then reads.)
    """
    validate = demo.validate_inputs

    def validate_inputs(block_fn: Any, inputs: list[Any]) -> None:
        wanted = block_fn.inputs
        if block_fn.api_name == api_name and len(inputs) < len(wanted):
            if not inputs:
                names = ", ".join(list(inspect.signature(block_fn.fn).parameters)[: len(wanted)])
                allowed = f"send the inputs in this order: {names} (all but the first may be left out)"
                raise refuse(wanted[0].label, "missing", allowed)
            inputs.extend(component.value for component in wanted[len(inputs) :])
        validate(block_fn, inputs)

    demo.validate_inputs = validate_inputs

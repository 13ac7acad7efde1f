"""A diffusion transformer with regionally AoT-compiled blocks, served by Gradio.

    python app.py                                 # FLUX.1-dev on a CUDA GPU
    MODEL_ID=assets/tiny-flux python app.py       # the bundled tiny pipeline, anywhere
    python app.py --no-compile                    # the eager pipeline, for comparison

What the UI offers (an input image for edit models, a guidance slider, default steps) comes from
the pipeline's row in families.py. Every option of compile.py works here too (flag or environment
variable; see README.md).
"""

import argparse
import logging
import math
import os
import random
import time
import warnings
from typing import Any

import gradio as gr
import spaces  # noqa: F401  (before torch: on ZeroGPU it patches torch before anything can touch CUDA)
import torch
from PIL import Image

from aot import replicas, zerogpu
from aot.families import family
from aot.options import Options, stops_in_one_line

# --- configuration ---------------------------------------------------------------------------
STARTED = time.perf_counter()
PARSER = argparse.ArgumentParser(
    description=__doc__, parents=[Options.parser()], formatter_class=argparse.RawDescriptionHelpFormatter
)
MAX_SEED = 2**31 - 1
MAX_STEPS = 50
MAX_GUIDANCE = 10.0
# Untrusted sizes, bounded before any work. A prompt: every family's text encoders read at most 512
# tokens (about 2,500 characters of English), so 10,000 characters loses nothing; a 10-million-
# character prompt took 95 s to tokenize. An input image is resized to the output (at most 1536 px
# a side), so a 50 MB, 64-megapixel upload is more than any camera sends.
MAX_PROMPT_CHARS = 10_000
MAX_IMAGE_BYTES = 50_000_000
MAX_IMAGE_PIXELS = 64_000_000
# ZeroGPU gives each request `duration` seconds of GPU and refuses a request that asks for more than
# its cap (C28). The main process cannot know whether the request will find a worker alive, so every
# request asks for a new worker's setup too. Measured on one full H200 through zerogpu_harness.py
# (bench.py's zerogpu rows, BENCHMARKS.md, 2026-12-01, FLUX.1-dev shapes): a new worker's first
# request takes 16.0 s compiled, 24.2 s eager (moving 17.5 / 34.0 GB of weights: 10.8 / 18.0 s); a
# step at 1024x1024 (4096 image tokens) takes 0.096 s with FA3 + FP8, 0.175 s eager; text encoders +
# VAE 0.2 s. ZeroGPU's card (half an RTX Pro 6000 Blackwell, no FA3) could not be
# measured here: x3 for it and for slack. spaces multiplies what is asked by its card's duration
# factor (1.5 on that card), which makes more room, not less.
NEW_WORKER_SECONDS = 3 * 16.0
# A LoRA switch (lora.Adapters.use): the first one in a worker also copies the base of the layers the
# LoRAs target. Measured on the H200 (bench.py's lora row, BENCHMARKS.md, 2026-12-01): rank 16 on all
# 418 attention and MLP layers of FLUX.1-dev's blocks, FP8: 0.58 s the first time (8.6 GB copied),
# 0.47 s on, 0.03 s off. x3 for ZeroGPU's card, as above.
LORA_SWITCH_SECONDS = 3 * 0.6
SECONDS_PER_STEP_AT_4096_TOKENS = 3 * 0.175
MAX_GPU_SECONDS = 120
EXAMPLES = [
    "a photo of a red fox in fresh snow, morning light",
    "an isometric pixel-art lighthouse on a cliff at dusk",
    "a bowl of ramen on a wooden table, steam rising, studio photo",
]
EDIT_EXAMPLES = [
    "turn it into a watercolor painting",
    "make it night, with the windows lit",
    "add a red umbrella in the foreground",
]

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
log = logging.getLogger("app")

# --- startup: load, compile, apply --------------------------------------------------------------
# One replica per GPU (AOT_DEVICES; one on ZeroGPU): each loads the weights, the first of each GPU
# model binds saved packages (AOT_LOAD) or compiles on the GPU, the others bind the same packages.
with stops_in_one_line(PARSER, enabled=__name__ == "__main__"):  # a setting that cannot work: one line
    OPTIONS = Options.from_env(PARSER.parse_args() if __name__ == "__main__" else None)
    REPLICAS = replicas.start(OPTIONS)
pipe = REPLICAS.pipes[0]  # the model's facts below are the same for every replica
RESOLUTION = OPTIONS.resolution(pipe.vae_scale_factor)
# Guidance-distilled FLUX.1-dev takes a guidance scale; timestep-distilled schnell (no guidance
# embedding) ignores it and needs few steps: `Family.guided` reads the config field that says so.
FAMILY = family(type(pipe).__name__)  # what the UI offers and how a call looks (families.py)
GUIDED = FAMILY.guided(pipe)
DEFAULT_STEPS, DEFAULT_GUIDANCE = FAMILY.defaults(pipe)
EDITS = FAMILY.image_input == "required"  # an input image must be given; "optional": it may be
TEXT_TOKENS = FAMILY.text_tokens  # the text length the blocks are compiled for
# Counts a prompt's tokens for the truncation note (None: the family names no tokenizer, no note).
TOKENIZER = getattr(pipe, FAMILY.tokenizer) if FAMILY.tokenizer else None
LORAS = ["none", *REPLICAS.adapters[0].names]  # what a request can pick (AOT_LORA_CHOICES)
if OPTIONS.compile:
    REPORT = REPLICAS.reports[0]
    log.info("compiled blocks:\n%s", REPORT)
    STATUS = REPORT.summary() + (f"; {len(REPLICAS)} replicas" if len(REPLICAS) > 1 else "")
else:
    STATUS = "eager pipeline (compile switched off: AOT_COMPILE=0 / --no-compile)"
zerogpu.check_size(pipe, OPTIONS.gpu_size)  # logs what a new ZeroGPU worker moves; warns where the size will not fit
log.info("%s; startup took %.1f s", STATUS, time.perf_counter() - STARTED)


# --- generation --------------------------------------------------------------------------------
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


def check_request(
    prompt: str,
    seed: int,
    randomize_seed: bool,
    width: int,
    height: int,
    steps: int,
    guidance: float,
    lora: str = "none",
    image: Image.Image | None = None,
) -> None:
    """Raise `gr.Error` saying what is allowed, before any GPU work.

    Gradio's sliders already refuse values that are not numbers or outside their range (`named`);
    this also covers prompts that are not text, too long or have nothing to read, sizes that are not
    multiples of 16, fractional values, a missing input image for an edit model (or one for a
    text-to-image model), and direct calls of `generate`.
    """
    if not isinstance(prompt, str):
        raise refuse(f"prompt={_shown(prompt, None)}: send text.")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise refuse(f"The prompt has {len(prompt):,} characters; use at most {MAX_PROMPT_CHARS:,}.")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end]
        raise refuse(f"The prompt holds {bad!r}, which is not text (a lone surrogate); send valid Unicode.") from None
    if not any(ch.isprintable() and not ch.isspace() for ch in prompt):
        raise refuse("Enter a prompt (it has no visible character).")
    if EDITS and image is None:
        raise refuse(f"Upload an input image: {FAMILY.label} edits an image (it is resized to the output size).")
    if FAMILY.image_input == "none" and image is not None:
        raise refuse(f"{FAMILY.label} generates from text only: leave the input image empty.")
    for name, value in (("width", width), ("height", height), ("steps", steps), ("seed", seed), ("guidance", guidance)):
        if not _finite_number(value):
            raise refuse(f"{name}={_shown(value, None)}: use a number.")
    for name, value in (("width", width), ("height", height), ("steps", steps), ("seed", seed)):
        if value != int(value):
            raise refuse(f"{name}={value}: use a whole number.")
    if not isinstance(randomize_seed, bool):
        raise refuse(f"randomize_seed={_shown(randomize_seed, None)}: use true or false.")
    try:
        RESOLUTION.check(int(height), int(width))
    except ValueError as exc:
        raise refuse(str(exc)) from None
    if not 1 <= steps <= MAX_STEPS:
        raise refuse(f"steps={steps}: use a whole number from 1 to {MAX_STEPS}.")
    if not 0.0 <= guidance <= MAX_GUIDANCE:
        raise refuse(f"guidance={guidance}: use a value from 0 to {MAX_GUIDANCE}.")
    if not 0 <= seed <= MAX_SEED:
        raise refuse(f"seed={seed}: use a whole number from 0 to {MAX_SEED}.")
    if lora not in LORAS:
        raise refuse(f"lora={lora!r}: use one of {', '.join(LORAS)} (AOT_LORA_CHOICES lists what is offered).")
    if not FAMILY.truncates and (tokens := prompt_tokens(prompt)) > TEXT_TOKENS:
        raise refuse(
            f"The prompt has {tokens} text tokens; {FAMILY.label} takes at most {TEXT_TOKENS} "
            "(its pipeline does not cut a longer one, and the blocks are compiled for that length)."
        )


def prompt_tokens(prompt: str) -> int:
    """The prompt's length in the family's tokenizer (0 where the family names none)."""
    return len(TOKENIZER(prompt).input_ids) if TOKENIZER is not None else 0


def gpu_seconds(replica, prompt, seed, width, height, steps, guidance, lora, image) -> int:
    """ZeroGPU duration for one request, in seconds: a new worker's setup + a LoRA switch + the steps,
    the per-step time scaled by the image tokens the blocks see (the output's, plus an input
    image's: `families.Family.image_tokens`); at most `MAX_GPU_SECONDS` (63 s at 1024x1024, 28 steps)."""
    tokens = FAMILY.image_tokens(RESOLUTION, int(height), int(width), references=int(image is not None))
    steps_s = steps * SECONDS_PER_STEP_AT_4096_TOKENS * tokens / 4096
    switch_s = LORA_SWITCH_SECONDS if len(LORAS) > 1 else 0
    return min(MAX_GPU_SECONDS, math.ceil(NEW_WORKER_SECONDS + switch_s + steps_s))


def infer(
    replica: int,
    prompt: str,
    seed: int,
    width: int,
    height: int,
    steps: int,
    guidance: float,
    lora: str,
    image: Image.Image | None,
):
    """(On the GPU.) One image as a PIL image, from replica number `replica` running LoRA `lora`
    ("none": the base weights); `image` is the input image of an edit model (a small PIL image,
    pickled), else None. The pipelines reach a ZeroGPU worker through fork (`REPLICAS`), never as
    arguments; so do their LoRAs, written into the worker's weights in place (lora.Adapters)."""
    pipe = REPLICAS.pipes[replica]
    REPLICAS.adapters[replica].use(None if lora == "none" else lora)
    generator = torch.Generator(device=pipe.device).manual_seed(seed)
    call = FAMILY.call(pipe, prompt, height, width, steps, guidance, image)
    return pipe(**call, generator=generator).images[0]


infer = zerogpu.gpu(infer, duration=gpu_seconds, size=OPTIONS.gpu_size)


def generate(
    prompt: str,
    seed: int,
    randomize_seed: bool,
    width: int,
    height: int,
    num_inference_steps: int,
    guidance_scale: float,
    lora: str = "none",
    image: Image.Image | None = None,
    progress=gr.Progress(track_tqdm=True),  # noqa: B008 (gradio injects it)
):
    """Generate one image with LoRA `lora` (one of `LORAS`; "none" by default); returns (PIL image,
    seed used, notes). Invalid input raises `gr.Error`.

    `image` is the input image of an edit model (required there, refused elsewhere). `lora` and
    `image` are the last arguments, optional, so text-only API clients call `/generate` as before.

    notes says what was generated (size, steps, seed: the UI's sliders round a typed value to their
    step without a word) and what the request did not get as asked (a prompt cut to the text length
    the blocks are compiled for), so that API clients learn it too, not only the UI's toast.
    """
    check_request(prompt, seed, randomize_seed, width, height, num_inference_steps, guidance_scale, lora, image)
    seed = random.randint(0, MAX_SEED) if randomize_seed else int(seed)
    steps = int(num_inference_steps)
    notes = f"{int(width)}x{int(height)} px, {steps} step{'s' * (steps != 1)}, seed {seed}."
    if lora != "none":
        notes += f" LoRA: {lora}."
    if not GUIDED and guidance_scale != DEFAULT_GUIDANCE:
        notes += f" Guidance {guidance_scale:g} was not used: this {FAMILY.label} model takes none."
    if image is not None:
        notes += f" The input image ({image.width}x{image.height}) was resized to {int(width)}x{int(height)}"
        if FAMILY.reference_size:
            notes += ", then by the pipeline to {1}x{0}".format(*FAMILY.reference_size(int(height), int(width)))
        notes += "."
    if FAMILY.truncates and prompt_tokens(prompt) > TEXT_TOKENS:
        cut = f"The prompt is longer than {TEXT_TOKENS} text tokens; the rest was ignored."
        gr.Warning(cut)
        notes += " " + cut
    with REPLICAS.take() as replica:
        start = time.perf_counter()
        log.info("replica %d started a request", replica)
        args = int(width), int(height), int(num_inference_steps), float(guidance_scale), lora, image
        output = infer(replica, prompt, seed, *args)
        log.info(
            "replica %d served %sx%s, %s steps in %.1f s",
            replica,
            width,
            height,
            num_inference_steps,
            time.perf_counter() - start,
        )
    return output, seed, notes


# --- UI ---------------------------------------------------------------------------------------
with gr.Blocks(title=f"{FAMILY.label}, compiled ahead of time") as demo:
    gr.Markdown(f"# {FAMILY.label}, compiled ahead of time\n`{OPTIONS.model}` · {STATUS}")
    with gr.Row():
        placeholder = "Describe the edit" if EDITS else "Describe the image"
        prompt = gr.Textbox(label="Prompt", placeholder=placeholder, scale=4, max_lines=4)
        run = gr.Button("Generate", variant="primary", scale=1)
    with gr.Row():
        input_image = named(
            gr.Image(
                label="Input image" if EDITS else "Reference image (optional)",
                type="pil",
                visible=FAMILY.image_input != "none",
            ),
            f"an image file (PNG, JPEG, WebP) of at most {MAX_IMAGE_BYTES // 10**6} MB and "
            f"{MAX_IMAGE_PIXELS // 10**6} megapixels",
        )
        result = gr.Image(label="Result", format="png")
    notes = gr.Markdown(label="notes")
    # The seed used goes to the API and into `notes`, not back into the Seed slider: outputs of a
    # refused request show an error badge, which on the slider read as "this seed is wrong".
    seed_used = gr.Number(visible=False, precision=0, label="seed")
    with gr.Accordion("Advanced", open=False):
        seed = named(gr.Slider(0, MAX_SEED, value=0, step=1, label="Seed"), f"a whole number from 0 to {MAX_SEED}")
        randomize_seed = gr.Checkbox(value=True, label="Randomize seed")
        with gr.Row():
            lo, hi, step = RESOLUTION.min_side, RESOLUTION.max_side, RESOLUTION.step
            sides = f"a multiple of {step} from {lo} to {hi} px"
            width = named(gr.Slider(lo, hi, value=min(max(1024, lo), hi), step=step, label="Width"), sides)
            height = named(gr.Slider(lo, hi, value=min(max(1024, lo), hi), step=step, label="Height"), sides)
        steps = named(gr.Slider(1, MAX_STEPS, value=DEFAULT_STEPS, step=1, label="Steps"), f"1 to {MAX_STEPS}")
        guidance = named(
            gr.Slider(0.0, MAX_GUIDANCE, value=DEFAULT_GUIDANCE, step=0.1, label="Guidance", visible=GUIDED),
            f"a number from 0 to {MAX_GUIDANCE:g}",
        )
        lora = named(
            gr.Dropdown(LORAS, value="none", label="LoRA", visible=len(LORAS) > 1), "one of " + ", ".join(LORAS)
        )
    gr.Examples(EDIT_EXAMPLES if EDITS else EXAMPLES, inputs=[prompt])
    gr.on(
        triggers=[run.click, prompt.submit],
        fn=generate,
        inputs=[prompt, seed, randomize_seed, width, height, steps, guidance, lora, input_image],
        outputs=[result, seed_used, notes],
        api_name="generate",
    )
demo.queue(default_concurrency_limit=REPLICAS.concurrency, max_size=REPLICAS.max_waiting)  # see Replicas.concurrency

if __name__ == "__main__":
    demo.launch(show_error=True)  # API clients get each error's message, not a generic one

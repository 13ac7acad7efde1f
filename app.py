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
import random
import time
from typing import Any

import gradio as gr
import spaces  # noqa: F401  (before torch: on ZeroGPU it patches torch before anything can touch CUDA)
import torch
from PIL import Image

import replicas
import zerogpu
from families import family
from options import Options

# --- configuration ---------------------------------------------------------------------------
STARTED = time.perf_counter()
PARSER = argparse.ArgumentParser(
    description=__doc__, parents=[Options.parser()], formatter_class=argparse.RawDescriptionHelpFormatter
)
OPTIONS = Options.from_env(PARSER.parse_args() if __name__ == "__main__" else None)
MAX_SEED = 2**31 - 1
MAX_STEPS = 50
MAX_GUIDANCE = 10.0
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

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
log = logging.getLogger("app")

# --- startup: load, compile, apply --------------------------------------------------------------
# One replica per GPU (AOT_DEVICES; one on ZeroGPU): each loads the weights, the first of each GPU
# model binds saved packages (AOT_LOAD) or compiles on the GPU, the others bind the same packages.
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


def named(component: gr.components.Component) -> gr.components.Component:
    """`component`, whose input errors name it: gradio's own say only "Value 4096 is greater than
    maximum value 1536.", and print a traceback in the server log for each refused request.

    (An instance attribute: a subclass of a gradio component makes gradio write a `.pyi` beside us.)
    """
    check = component.preprocess

    def preprocess(payload: Any) -> Any:
        try:
            return check(payload)
        except gr.Error as exc:
            raise refuse(f"{component.label}: {exc.message}") from None

    component.preprocess = preprocess
    return component


def check_request(
    prompt: str,
    seed: int,
    width: int,
    height: int,
    steps: int,
    guidance: float,
    lora: str = "none",
    image: Image.Image | None = None,
) -> None:
    """Raise `gr.Error` saying what is allowed, before any GPU work.

    Gradio's sliders already refuse values outside their range (`named`); this also covers sizes
    that are not multiples of 16, fractional values, prompts with nothing to read, a missing input
    image for an edit model (or one for a text-to-image model), and direct calls of `generate`.
    """
    if not any(ch.isprintable() and not ch.isspace() for ch in prompt or ""):
        raise refuse("Enter a prompt (it has no visible character).")
    if EDITS and image is None:
        raise refuse(f"Upload an input image: {FAMILY.label} edits an image (it is resized to the output size).")
    if FAMILY.image_input == "none" and image is not None:
        raise refuse(f"{FAMILY.label} generates from text only: leave the input image empty.")
    for name, value in (("width", width), ("height", height), ("steps", steps), ("seed", seed)):
        if value != int(value):
            raise refuse(f"{name}={value}: use a whole number.")
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
    check_request(prompt, seed, width, height, num_inference_steps, guidance_scale, lora, image)
    seed = random.randint(0, MAX_SEED) if randomize_seed else int(seed)
    notes = f"{int(width)}x{int(height)} px, {int(num_inference_steps)} steps, seed {seed}."
    if lora != "none":
        notes += f" LoRA: {lora}."
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
        input_image = gr.Image(
            label="Input image" if EDITS else "Reference image (optional)",
            type="pil",
            visible=FAMILY.image_input != "none",
        )
        result = gr.Image(label="Result", format="png")
    notes = gr.Markdown()
    # The seed used goes to the API and into `notes`, not back into the Seed slider: outputs of a
    # refused request show an error badge, which on the slider read as "this seed is wrong".
    seed_used = gr.Number(visible=False, precision=0)
    with gr.Accordion("Advanced", open=False):
        seed = named(gr.Slider(0, MAX_SEED, value=0, step=1, label="Seed"))
        randomize_seed = gr.Checkbox(value=True, label="Randomize seed")
        with gr.Row():
            lo, hi, step = RESOLUTION.min_side, RESOLUTION.max_side, RESOLUTION.step
            width = named(gr.Slider(lo, hi, value=min(max(1024, lo), hi), step=step, label="Width"))
            height = named(gr.Slider(lo, hi, value=min(max(1024, lo), hi), step=step, label="Height"))
        steps = named(gr.Slider(1, MAX_STEPS, value=DEFAULT_STEPS, step=1, label="Steps"))
        guidance = named(
            gr.Slider(0.0, MAX_GUIDANCE, value=DEFAULT_GUIDANCE, step=0.1, label="Guidance", visible=GUIDED)
        )
        lora = named(gr.Dropdown(LORAS, value="none", label="LoRA", visible=len(LORAS) > 1))
    gr.Examples(EXAMPLES, inputs=[prompt])
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

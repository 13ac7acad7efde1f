"""A diffusion transformer, compiled ahead of time block by block, served by Gradio.

    python app.py                                 # MODEL_ID below, on a CUDA GPU
    MODEL_ID=assets/tiny-flux python app.py       # the bundled tiny pipeline, anywhere
    python app.py --no-compile                    # the eager pipeline, for comparison
    python app.py --help                          # every option: a flag and an environment variable each

This file is the one to edit. Top to bottom: the knobs (model, page, limits); `start`: load the
pipeline, call compile.py's `compile_transformer` (one `@spaces.GPU(duration=1500)` call: load
verified packages, or capture, export and compile each repeated block class with the GPU's FA3 and
FP8 trials), print its report, apply it; `infer`, a request's `@spaces.GPU` function, with its
duration rule; `generate`, the page's and the API's /generate; the page. A new control is a field
of `Request` and its widget in `ui`; a pipeline that takes it names it in its row's `controls`
(aot/families.py).
"""

import spaces  # first: on ZeroGPU it patches torch before anything can touch CUDA

# isort: split
import argparse
import dataclasses
import inspect
import logging
import math
import os
import time

import gradio as gr
from PIL import Image

from aot import (
    Limits,
    Options,
    Server,
    apply_,
    cancel,
    gpu_model,
    images,
    load_pipelines,
    preflight,
    save_and_push,
    usage_errors,
    zerogpu,
)
from aot.results import delete_cache
from aot.server import fill_short_calls
from compile import compile_transformer

# --- The knobs ---------------------------------------------------------------------------------
MODEL_ID = "black-forest-labs/FLUX.1-dev"  # a diffusers pipeline with a row in aot/families.py (MODEL_ID=... overrides)
TITLE = "{label}, compiled ahead of time"  # {label}: the model family's name, e.g. FLUX.1
EXAMPLES = [
    "a photo of a red fox in fresh snow, morning light",
    "an isometric pixel-art lighthouse on a cliff at dusk",
    "a bowl of ramen on a wooden table, steam rising, studio photo",
]
EDIT_EXAMPLES = [  # for models that edit an input image: (prompt, image)
    ["turn it into a watercolor painting", "assets/example.png"],
    ["make it night, with the windows lit", "assets/example.png"],
    ["add a red umbrella in the foreground", "assets/example.png"],
]
# What a request may ask for. The packages are compiled for every side in MIN_SIDE..MAX_SIDE px
# (multiples of 16, any aspect ratio; AOT_MIN_SIDE / AOT_MAX_SIDE override).
MIN_SIDE, MAX_SIDE = 512, 1536
MAX_STEPS = 50
MAX_GUIDANCE = 10.0
MAX_SEED = 2**31 - 1
# ZeroGPU: the card size of every GPU call: None (spaces' default: half an RTX Pro 6000, 48 GB, or
# the whole card at twice the quota where the weights packed at launch pass 42 GiB), "large", "xlarge".
GPU_SIZE = None
# ZeroGPU gives a request `duration` seconds of GPU and refuses one that asks for more than its cap.
# The main process cannot know whether a request finds a worker alive, so each asks for a new
# worker's setup too. Each is 3 x a time measured on the H200 (BENCHMARKS.md, "The GPU durations a
# request asks for"): a new worker's first request, the slowest LoRA switch, an eager step at 1024x1024.
NEW_WORKER_SECONDS = 3 * 16.0
LORA_SWITCH_SECONDS = 3 * 0.6
SECONDS_PER_STEP_AT_4096_TOKENS = 3 * 0.175
MAX_GPU_SECONDS = 120

OPTION_DEFAULTS = {"model": MODEL_ID, "min_side": MIN_SIDE, "max_side": MAX_SIDE}  # flags and env vars win
LIMITS = Limits(max_steps=MAX_STEPS, max_guidance=MAX_GUIDANCE, max_seed=MAX_SEED)
log = logging.getLogger("app")


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: a field per control, in the order of the page's inputs and the API's
    parameters. A field a call leaves out gets the loaded model's default (`Server.defaults`: the
    widgets start there, and gradio_client and short raw HTTP calls get it too); a number or a
    choice sent as null is refused, saying what is allowed."""

    prompt: str
    seed: int | None = None
    randomize_seed: bool | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    lora: str | None = None
    image: Image.Image | None = None
    negative_prompt: str | None = None


SERVER: Server | None = None  # set by `start`; on ZeroGPU the GPU calls reach its pipelines through fork


def start(options: Options, pipe=None) -> Server:
    """Load the pipeline (or take `pipe`), compile or load its packages, apply them: what
    `python app.py` runs before it serves (and tools/bench.py with its own pipeline).

    Raises:
        RuntimeError, ValueError, OSError: a setting that cannot work (`usage_errors` makes each one line).
    """
    global SERVER
    started = time.perf_counter()
    pipes = [pipe] if pipe is not None else load_pipelines(options)  # one per GPU; checked before weights load
    reports, compiled = [], {}  # GPU model -> its packages: replicas on one GPU model bind the same ones
    for replica in pipes:
        if not options.compile:
            reports.append(None)
            continue
        gpu = gpu_model(replica.device) if len(pipes) > 1 else ""  # one replica: no CUDA query (ZeroGPU)
        if gpu not in compiled:
            compiled[gpu] = compile_transformer(replica, options, GPU_SIZE)  # the startup's GPU call
            if options.save:  # AOT_SAVE (and AOT_PUSH): packages to load at the next start
                try:
                    log.info("saved packages to %s", save_and_push(compiled[gpu], options))
                except (OSError, RuntimeError) as exc:
                    log.warning("packages not saved to %s (%s); serving them anyway", options.save, exc)
        reports.append(apply_(replica, compiled[gpu]))
        log.info("compiled blocks:\n%s", reports[-1])
    SERVER = Server(pipes, reports, options, LIMITS, GPU_SIZE)
    log.info("%s; startup took %.1f s", SERVER.status, time.perf_counter() - started)
    return SERVER


def gpu_seconds(replica: int, request: Request, seed: int, stop: int) -> int:
    """ZeroGPU duration of one request, in seconds: a new worker's setup, a LoRA switch where
    LoRAs are offered, and the steps, each step's time scaled by the image tokens the blocks see;
    at most `MAX_GPU_SECONDS` (63 s at 1024x1024 and 28 steps). Takes `infer`'s arguments, as
    spaces calls it."""
    steps_s = request.num_inference_steps * SECONDS_PER_STEP_AT_4096_TOKENS * SERVER.image_tokens(request) / 4096
    switch_s = LORA_SWITCH_SECONDS if len(SERVER.loras) > 1 else 0
    return min(MAX_GPU_SECONDS, math.ceil(NEW_WORKER_SECONDS + switch_s + steps_s))


@spaces.GPU(duration=gpu_seconds, size=GPU_SIZE)
@zerogpu.worker  # the worker's exceptions, and the CUDA graph shapes it checked, come back whole
def infer(replica: int, request: Request, seed: int, stop: int) -> Image.Image:
    """(On the GPU.) One image for `request` (prepared) on replica `replica`, ending at the next step
    once stop flag `stop` is raised (aot/cancel.py). On ZeroGPU a forked worker runs it: the request
    is pickled, the pipelines reach it through fork (`SERVER`)."""
    return SERVER.infer(replica, request, seed, stop)


def run(values: tuple, stop: int) -> tuple[str | None, int, str]:
    """One request from its values (one per `Request` field, in order; left out: the model's
    defaults) to (PNG file, seed used, notes); no file if it was stopped. Raises `gr.Error` for a
    request that cannot be served. In a worker thread (`generate`)."""
    request, seed, notes = SERVER.prepare(SERVER.fill(Request(*values)))
    with SERVER.replica(request) as replica:
        image = infer(replica, request, seed, stop)
    if cancel.stopped(stop):
        return None, seed, "Stopped: the request was cancelled."  # nobody is waiting for it
    return SERVER.results.write(image, seed), seed, notes  # a PNG of its own, deleted after AOT_RESULTS_MAX_AGE


async def generate(*values):
    """/generate: `run` in a worker thread; a cancelled request (gradio's cancel) stops at its next
    denoising step and writes nothing (`cancel.cancellable`)."""
    return await cancel.cancellable(run, values[: len(FIELDS)])  # gradio adds its progress tracker last


# gradio names the API's parameters after generate's (Request's fields), and shows the pipeline's
# progress bar for a parameter whose default is a gr.Progress.
PARAMETER = inspect.Parameter.POSITIONAL_OR_KEYWORD
FIELDS = [inspect.Parameter(f.name, PARAMETER, default=f.default) for f in dataclasses.fields(Request)]
PROGRESS = inspect.Parameter("progress", PARAMETER, default=gr.Progress(track_tqdm=True))
generate.__signature__ = inspect.Signature([*FIELDS, PROGRESS])


def ui(server: Server) -> gr.Blocks:
    """The page: a widget per `Request` field at the model's defaults, /generate, the status line."""
    family, sides, defaults = server.family, server.resolution, server.defaults
    title = TITLE.format(label=family.label)
    model = server.options.model
    on_hub = model.count("/") == 1 and not os.path.exists(model)
    shown = f"[{model}](https://huggingface.co/{model})" if on_hub else f"`{model}`"
    controls = {}
    # gradio deletes each result (and upload) once it is older than AOT_RESULTS_MAX_AGE
    with gr.Blocks(title=title, delete_cache=delete_cache(server.options.results_max_age)) as demo:
        gr.Markdown(f"# {title}\n{shown} · {server.status}")
        with gr.Row():
            with gr.Column():
                placeholder = "Describe the edit" if server.edits else "Describe the image"
                controls["prompt"] = gr.Textbox(label="Prompt", placeholder=placeholder, max_lines=4)
                controls["negative_prompt"] = gr.Textbox(
                    value=defaults["negative_prompt"],
                    label="Negative prompt",
                    placeholder="What the image should not show (optional)",
                    max_lines=2,
                    visible="negative_prompt" in family.controls,
                )
                label = "Reference image (optional)" if family.image_input == "optional" else "Input image"
                image = gr.Image(label=label, type="pil", image_mode=None, visible=family.image_input != "none")
                controls["image"] = server.guard("image", image, images.ALLOWED)
                run = gr.Button("Generate", variant="primary")
            with gr.Column():
                result = gr.Image(label="Result", format="png")
                notes = gr.Markdown(label="notes")
        # The seed used goes to the API and into `notes`, not back into the Seed slider: outputs of a
        # refused request show an error badge, which on the slider read as "this seed is wrong".
        seed_used = gr.Number(visible=False, precision=0, label="seed")
        with gr.Accordion("Advanced", open=False):
            with gr.Row():
                seed = gr.Slider(0, MAX_SEED, value=defaults["seed"], step=1, precision=0, label="Seed", scale=3)
                controls["seed"] = server.guard("seed", seed, f"a whole number from 0 to {MAX_SEED}")
                reuse = gr.Button("Reuse the last seed", scale=1)
                controls["randomize_seed"] = gr.Checkbox(value=defaults["randomize_seed"], label="Randomize seed")
            with gr.Row():
                for name, text in (("width", "Width"), ("height", "Height")):
                    lo, hi, step = sides.min_side, sides.max_side, sides.step
                    slider = gr.Slider(lo, hi, value=defaults[name], step=step, precision=0, label=text)
                    controls[name] = server.guard(name, slider, sides.sides)
            steps = defaults["num_inference_steps"]
            steps = gr.Slider(family.min_steps, MAX_STEPS, value=steps, step=1, precision=0, label="Steps")
            controls["num_inference_steps"] = server.guard("num_inference_steps", steps, server.steps_allowed)
            guidance = gr.Slider(
                0.0, MAX_GUIDANCE, value=defaults["guidance_scale"], step=0.1, label="Guidance", visible=server.guided
            )
            guidance_allowed = f"a number from 0 to {MAX_GUIDANCE:g}"
            controls["guidance_scale"] = server.guard("guidance_scale", guidance, guidance_allowed)
            loras = gr.Dropdown(server.loras, value=defaults["lora"], label="LoRA", visible=len(server.loras) > 1)
            offered = "one of " + ", ".join(server.loras) if len(server.loras) > 1 else "none: no LoRA is offered"
            controls["lora"] = server.guard("lora", loras, offered)
        if server.edits:
            gr.Examples(EDIT_EXAMPLES, inputs=[controls["prompt"], controls["image"]])
            # The output follows the input image's aspect ratio: the sliders show the size it gets.
            sizes = [controls["width"], controls["height"]]
            controls["image"].change(server.size_for, controls["image"], sizes, api_visibility="private")
        else:
            gr.Examples(EXAMPLES, inputs=[controls["prompt"]])
        gr.on(
            triggers=[run.click, controls["prompt"].submit],
            fn=generate,
            inputs=[controls[f.name] for f in dataclasses.fields(Request)],
            outputs=[result, seed_used, notes],
            api_name="generate",
        )
        reuse.click(
            lambda used: (used, False) if used is not None else (gr.update(), gr.update()),
            seed_used,
            [controls["seed"], controls["randomize_seed"]],
            api_visibility="private",
        )
    fill_short_calls(demo, "generate")
    # How many requests run at once and wait: one per replica, or ZeroGPU's own scheduling (Replicas.concurrency).
    return demo.queue(default_concurrency_limit=server.replicas.concurrency, max_size=server.replicas.max_waiting)


def read_options(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> Options:
    """The options of `python app.py`: flags (`argv`), then environment variables, then the knobs above.

    Raises:
        ValueError: an environment variable holds a value its option does not allow.
    """
    parser = parser or argparse.ArgumentParser(parents=[Options.parser(OPTION_DEFAULTS)])
    return Options.from_env(parser.parse_args(argv), defaults=OPTION_DEFAULTS)


def main() -> None:
    """`python app.py`: the options, startup, then serve. A setting that cannot work stops it with
    one line (`usage_errors`)."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        description=__doc__,
        parents=[Options.parser(OPTION_DEFAULTS)],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    with usage_errors(parser):
        options = read_options(parser=parser)
        port = preflight.serving_port()  # a taken port, or a cache folder that cannot be written, stops
        preflight.check_cache_writable()  # app.py now, not after minutes of loading and compiling
        server = start(options)
    ui(server).launch(show_error=True, server_port=port)  # API clients get each error's message


if __name__ == "__main__":
    main()

"""A diffusion transformer with regionally AoT-compiled blocks, served by Gradio.

    python app.py                                 # FLUX.1-dev on a CUDA GPU
    MODEL_ID=assets/tiny-flux python app.py       # the bundled tiny pipeline, anywhere
    python app.py --no-compile                    # the eager pipeline, for comparison

This file is yours to edit: the request, the UI, startup. The engine is `aot/` (README.md's file
list). What the UI offers (an input image for edit models, a guidance slider, default steps) comes
from the pipeline's row in aot/families.py. Every option of compile.py works here too (flag or
environment variable; see README.md). A new control is a field of `Request` and its widget in
`ui`; a pipeline that takes it names it in its row's `controls`.
"""

import argparse
import dataclasses
import inspect
import logging

import gradio as gr
from PIL import Image

from aot import Options, Space, stops_in_one_line  # first: imports spaces, which on ZeroGPU patches torch
from aot.space import MAX_GUIDANCE, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_SEED, MAX_STEPS, image_file, named

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


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: a field per control, in the order of the UI's inputs and the API's parameters.
    Fields after `prompt` have defaults, so API clients may leave out the last ones."""

    prompt: str
    seed: int = 0
    randomize_seed: bool = True
    width: int = 1024
    height: int = 1024
    num_inference_steps: int = 28
    guidance_scale: float = 3.5
    lora: str = "none"
    image: Image.Image | None = None
    negative_prompt: str = ""


SPACE: Space | None = None  # set by `start`


def start(options: Options, pipe=None) -> Space:
    """Load (or take `pipe`), compile or load the packages, apply them; what `python app.py` runs
    first, and tools (tools/bench.py) with their own pipeline. On ZeroGPU the compile is the
    startup's GPU call (aot/optimize.py)."""
    global SPACE
    SPACE = Space.start(options, pipe)
    return SPACE


def generate(*values):
    """/generate: the values of `Request`'s fields, in order; returns (PNG file, seed used, notes)."""
    image, seed, notes = SPACE.generate(Request(*values[: len(FIELDS)]))  # gradio adds its progress tracker last
    return image_file(image, seed), seed, notes  # a file per request: two same images never share one


# gradio names the API's parameters after generate's (Request's fields), and shows the pipeline's
# progress bar for a parameter whose default is a gr.Progress.
PARAMETER = inspect.Parameter.POSITIONAL_OR_KEYWORD
FIELDS = [inspect.Parameter(f.name, PARAMETER, default=f.default) for f in dataclasses.fields(Request)]
PROGRESS = inspect.Parameter("progress", PARAMETER, default=gr.Progress(track_tqdm=True))
generate.__signature__ = inspect.Signature([*FIELDS, PROGRESS])


def ui(space: Space) -> gr.Blocks:
    """The page: a widget per `Request` field, /generate, and the space's status line."""
    family, resolution, options = space.family, space.resolution, space.options
    controls = {}
    with gr.Blocks(title=f"{family.label}, compiled ahead of time") as demo:
        gr.Markdown(f"# {family.label}, compiled ahead of time\n`{options.model}` · {space.status}")
        with gr.Row():
            placeholder = "Describe the edit" if space.edits else "Describe the image"
            controls["prompt"] = gr.Textbox(label="Prompt", placeholder=placeholder, scale=4, max_lines=4)
            run = gr.Button("Generate", variant="primary", scale=1)
        with gr.Row():
            controls["image"] = named(
                gr.Image(
                    label="Input image" if space.edits else "Reference image (optional)",
                    type="pil",
                    visible=family.image_input != "none",
                ),
                f"an image file (PNG, JPEG, WebP) of at most {MAX_IMAGE_BYTES // 10**6} MB and "
                f"{MAX_IMAGE_PIXELS // 10**6} megapixels",
            )
            result = gr.Image(label="Result", format="png")
        controls["negative_prompt"] = gr.Textbox(
            value="",  # an initial value makes it optional for gradio_client (None would not)
            label="Negative prompt",
            placeholder="What the image should not show (optional)",
            max_lines=2,
            visible="negative_prompt" in family.controls,
        )
        notes = gr.Markdown(label="notes")
        # The seed used goes to the API and into `notes`, not back into the Seed slider: outputs of a
        # refused request show an error badge, which on the slider read as "this seed is wrong".
        seed_used = gr.Number(visible=False, precision=0, label="seed")
        with gr.Accordion("Advanced", open=False):
            seeds = f"a whole number from 0 to {MAX_SEED}"
            controls["seed"] = named(gr.Slider(0, MAX_SEED, value=0, step=1, label="Seed"), seeds)
            controls["randomize_seed"] = gr.Checkbox(value=True, label="Randomize seed")
            with gr.Row():
                lo, hi, step, sides = resolution.min_side, resolution.max_side, resolution.step, resolution.sides
                side = min(max(1024, lo), hi)
                controls["width"] = named(gr.Slider(lo, hi, value=side, step=step, label="Width"), sides)
                controls["height"] = named(gr.Slider(lo, hi, value=side, step=step, label="Height"), sides)
            controls["num_inference_steps"] = named(
                gr.Slider(family.min_steps, MAX_STEPS, value=space.default_steps, step=1, label="Steps"),
                space.steps_allowed,
            )
            guidance = gr.Slider(
                0.0, MAX_GUIDANCE, value=space.default_guidance, step=0.1, label="Guidance", visible=space.guided
            )
            controls["guidance_scale"] = named(guidance, f"a number from 0 to {MAX_GUIDANCE:g}")
            loras = space.loras
            controls["lora"] = named(
                gr.Dropdown(loras, value="none", label="LoRA", visible=len(loras) > 1), "one of " + ", ".join(loras)
            )
        gr.Examples(EDIT_EXAMPLES if space.edits else EXAMPLES, inputs=[controls["prompt"]])
        gr.on(
            triggers=[run.click, controls["prompt"].submit],
            fn=generate,
            inputs=[controls[f.name] for f in dataclasses.fields(Request)],
            outputs=[result, seed_used, notes],
            api_name="generate",
        )
    # How many requests run at once and wait: one per replica, or ZeroGPU's own scheduling (Replicas.concurrency).
    return demo.queue(default_concurrency_limit=space.replicas.concurrency, max_size=space.replicas.max_waiting)


def main() -> None:
    """`python app.py`: the options from flags and the environment, startup, then serve. A setting
    that cannot work stops it with one line (`options.stops_in_one_line`)."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        description=__doc__, parents=[Options.parser()], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    with stops_in_one_line(parser):
        space = start(Options.from_env(parser.parse_args()))
    ui(space).launch(show_error=True)  # API clients get each error's message, not a generic one


if __name__ == "__main__":
    main()

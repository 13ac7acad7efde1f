"""`load_pipeline`: a diffusers pipeline from a folder or the Hub, checked before any weight loads."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import httpx
import torch
from huggingface_hub import constants

from aot import lora, portability
from aot.destinations import check_push_target, check_save_target
from aot.families import family
from aot.model_config import vae_scale_factor
from aot.options import Options
from aot.plans import refuse_impossible_requests

log = logging.getLogger("compile")


def tiny_pipelines() -> list[str]:
    """The bundled tiny pipelines (`assets/tiny-*/` with a `model_index.json`), as MODEL_ID names them."""
    assets = Path(__file__).resolve().parents[1] / "assets"
    found = sorted(p.parent.name for p in assets.glob("tiny-*/model_index.json"))
    return [f"assets/{name}" for name in found]


TINY_ADVICE = "The bundled tiny pipelines run anywhere (e.g. MODEL_ID=assets/tiny-flux): " + ", ".join(tiny_pipelines())

# Largest transformer `load_pipeline` runs on a CPU: FLUX.1-dev (12B) would need ~48 GB in float32
# and minutes per step.
CPU_MAX_PARAMS = 1_000_000_000


def load_pipeline(options: Options) -> Any:
    """Load `options.model` as the pipeline class its `model_index.json` names, on `options.device`
    in `options.dtype`, with the LoRAs of `options.lora` fused into its weights (lora.fuse_); the
    class must have a row in families.py.

    Everything that can be checked without the weights is checked first, in seconds: explicit fast
    paths this machine cannot run, a push target without a token, a pipeline class that is not
    supported, the side range against the model's pixel step (read from its VAE config), a save
    folder that cannot be written, a Hub that cannot be reached, a model too large for a machine
    without CUDA. Beside the weights it starts the CPU ISA probe a compile for a CPU needs
    (`portability.needs_probe`; a CUDA compile skips it), unless nothing is compiled
    (`--no-compile`) or packages are to be loaded (`AOT_LOAD`, which does not need it; if they are
    then refused, the compile waits for the probe).

    Raises:
        RuntimeError: the model cannot be fetched, it is too large to run without CUDA, its
            pipeline needs a module that is not installed, or an explicit option cannot work here.
        ValueError: the pipeline class is not supported; the side range does not fit the model's
            pixel step; a LoRA source that is neither a path nor a Hub repo id, or a LoRA that
            cannot be applied (lora.read).
    """
    import diffusers  # heavy: at first use

    if not options.model:
        raise ValueError(f"no model: name one with --model or MODEL_ID (a Hub repo id or a folder). {TINY_ADVICE}")
    cuda = torch.cuda.is_available()
    if options.device.startswith("cuda") and not cuda:
        raise RuntimeError(
            f"device={options.device} but torch sees no CUDA GPU (torch {torch.__version__}); "
            "use --device auto or cpu, or a CUDA build of torch on a GPU machine"
        )
    device = torch.device(options.device if options.device != "auto" else "cuda" if cuda else "cpu")
    dtype = getattr(torch, options.dtype) if options.dtype != "auto" else torch.bfloat16 if cuda else torch.float32
    if options.compile:
        refuse_impossible_requests(options, device)
    if options.compile and options.save:
        check_save_target(options.save)
    if options.push:
        check_push_target(options.push)
    for spec in options.lora_specs + options.choice_specs:
        spec.check_source()
    index = _model_config(diffusers.DiffusionPipeline, options.model, None)
    pipeline_class = index.get("_class_name", "")
    row = family(pipeline_class)  # refuses an unsupported class before any weight loads
    if row.missing():
        raise RuntimeError(
            f"{pipeline_class} needs {', '.join(row.missing())}, which is not installed: "
            f"pip install {' '.join(row.missing())}"
        )
    transformer_class = getattr(diffusers, index["transformer"][1])
    config = _model_config(transformer_class, options.model, "transformer")
    if device.type == "cpu":
        with torch.device("meta"):
            params = sum(p.numel() for p in transformer_class.from_config(config).parameters())
        if params > CPU_MAX_PARAMS:
            raise RuntimeError(
                f"{options.model} has a {params / 1e9:.1f}B-parameter transformer ({params * 2 / 1e9:.0f} GB in "
                f"bfloat16): it needs a CUDA GPU with room for it and the text encoders. {TINY_ADVICE}"
            )
    vae = _model_config(getattr(diffusers, index["vae"][1]), options.model, "vae")
    options.resolution(vae_scale_factor=vae_scale_factor(vae))
    if options.compile and not options.load and portability.needs_probe(device):
        portability.probe_in_background()  # it overlaps with loading the weights
    pipe = getattr(diffusers, pipeline_class).from_pretrained(options.model, dtype=dtype).to(device)
    if options.lora_specs:
        lora.fuse_(pipe, list(options.lora_specs))
    return pipe


def _model_config(cls: Any, model: str, subfolder: str | None) -> dict[str, Any]:
    """`cls.load_config(model, subfolder=...)` from a folder, the local Hub cache, or the Hub;
    `subfolder=None` reads the model's own `model_index.json`.

    huggingface_hub retries an unreachable Hub for about 30 s before it fails with "does not
    appear to have a file named config.json"; one request with a 5 s timeout tells first.

    Raises:
        RuntimeError: the config cannot be read, saying why (no such folder, Hub unreachable,
            no access to a gated repo).
    """
    advice = f"Offline, or without access to a gated Hub repo: {TINY_ADVICE}"
    first = model.replace(os.sep, "/").split("/")[0]
    if not os.path.isdir(model) and (model.startswith((".", "/", "~")) or first and os.path.isdir(first)):
        raise RuntimeError(f"cannot load {model!r}: there is no such folder. {TINY_ADVICE}")
    if not os.path.isdir(model):
        try:
            return cls.load_config(model, subfolder=subfolder, local_files_only=True)
        except OSError:
            pass  # not in the cache: ask the Hub
        try:
            httpx.head(constants.ENDPOINT, timeout=5.0)
        except httpx.HTTPError as exc:
            raise RuntimeError(
                f"cannot load {model!r}: it is not a folder, not in the local Hub cache, and the Hub "
                f"({constants.ENDPOINT}) cannot be reached ({type(exc).__name__}: {exc}). {advice}"
            ) from None
    try:
        return cls.load_config(model, subfolder=subfolder)
    except OSError as exc:
        if os.path.isdir(model):  # a folder that holds no pipeline: no Hub advice applies
            advice = f"Give a folder that holds a diffusers pipeline (its model_index.json). {TINY_ADVICE}"
        raise RuntimeError(f"cannot load {model!r} ({exc}). {advice}") from exc

"""Options shared by `compile.py` (shape range) and `app.py` (UI limits).

Every option is one field of the frozen `Options` dataclass, with one CLI flag and one environment
variable; `python compile.py --help` and `python app.py --help` list them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aot.lora_specs import parse
from aot.resolution import Resolution

# Image sizes the compiled blocks accept: each side a multiple of the pipeline's pixel step (16 for
# FLUX: VAE downsampling 8 x 2x2 latent packing) between these bounds, any aspect ratio in between.
# Image tokens = (height / 16) * (width / 16): 512x512 -> 1024 tokens, 1536x1536 -> 9216.
MIN_SIDE, MAX_SIDE = 512, 1536
# The widest side range a compile may cover: 2048 px a side (4.2 MP square, 16384 image tokens)
# leaves room for wide formats at the sizes these models are made for (e.g. FLUX.1's model cards:
# up to about 2 megapixels) and stops larger ranges, whose compile and memory only grow.
LARGEST_SIDE = 2048


# The FP8 granularities a plan or `--fp8-granularity` can name. "row": a scale per row of the
# activation (per token) and of the weight (per output channel), applied in cuBLAS's row-wise scaled
# GEMM (sm_90, sm_100). "row-after": the same FP8 values and scales, applied after a GEMM with unit
# scales (`fp8.RowScalesAfterGEMM`), where cuBLAS scales FP8 only per tensor (sm_120, sm_89).
# "tensor": one scale per activation and one per weight.
FP8_GRANULARITIES = ("row", "row-after", "tensor")


def _option(env: str, help: str, **argparse_kwargs: Any) -> dict[str, Any]:
    return {"env": env, "help": help, **argparse_kwargs}


@dataclass(frozen=True)
class Options:
    """How to load and compile. The defaults take every fast path the hardware allows (`auto`);
    each can be switched off or forced.

    Precedence: command-line flag, then environment variable, then the defaults `from_env` is
    given (app.py's `MODEL_ID`, `MIN_SIDE`, `MAX_SIDE`), then the default below.
    """

    model: str = field(
        default="",
        metadata=_option("MODEL_ID", "diffusers pipeline (a class in families.py): Hub repo id or local folder"),
    )
    compile: bool = field(
        default=True,
        metadata=_option("AOT_COMPILE", "compile the repeated blocks; off serves the eager pipeline"),
    )
    attention: str = field(
        default="auto",
        metadata=_option(
            "AOT_ATTENTION",
            "attention inside the compiled blocks: fa3 (FlashAttention-3, Hopper GPUs), fa3-fp8 (its FP8"
            " forward: Q and K unscaled where their norms bound them, V scaled per head), sage (INT8 Q.K, FP8"
            " P.V in Triton, compute capability >= 8.9), sdpa, or auto",
            choices=("auto", "fa3", "fa3-fp8", "sage", "sdpa"),
        ),
    )
    fa3_kernel: str = field(
        default="kernels-community/flash-attn3",
        metadata=_option(
            "AOT_FA3_KERNEL",
            "where FA3 comes from: a Hub kernel repo (owner/name, loaded with the `kernels` library)"
            " or an importable module name that provides flash_attn_func",
        ),
    )
    fp8: str = field(
        default="auto",
        metadata=_option(
            "AOT_FP8",
            "FP8 weights and activations in the blocks' linear layers (torchao; compute capability >= 8.9)",
            choices=("auto", "on", "off"),
        ),
    )
    fp8_granularity: str = field(
        default="auto",
        metadata=_option(
            "AOT_FP8_GRANULARITY",
            "FP8 scaling: one scale per row (activations per token, weights per output channel) in the GEMM, the"
            " same scales applied after it (row-after: where cuBLAS scales FP8 only per tensor), per tensor, or auto:"
            " the GPU's plan (plans.PLANS: row then tensor on Hopper, row-after then tensor on sm_89 and sm_120)",
            choices=("auto", *FP8_GRANULARITIES),
        ),
    )
    norm_rope: str = field(
        default="auto",
        metadata=_option(
            "AOT_NORM_ROPE",
            "each head's RMS norm and RoPE in one Triton kernel of ours (aot/norm_rope.py) where attention reads"
            " them directly, in place of Inductor's: on, off, or auto (the GPU's plan: plans.PLANS)",
            choices=("auto", "on", "off"),
        ),
    )
    row_fp8: str = field(
        default="auto",
        metadata=_option(
            "AOT_ROW_FP8",
            "the FP8 rows of a GEMM's input made from a cat or a GELU in one Triton kernel of ours (aot/row_fp8.py),"
            " in place of Inductor's: on, off, or auto (the GPU's plan: plans.PLANS; none takes it yet)",
            choices=("auto", "on", "off"),
        ),
    )
    plan: str = field(
        default="auto",
        metadata=_option(
            "AOT_PLAN",
            "which GPU's plan of fast-path trials to follow: auto (this GPU's compute capability) or a capability"
            " such as 12.0, to rehearse ZeroGPU's RTX Pro 6000 plan on another GPU",
        ),
    )
    text_fp8: str = field(
        default="auto",
        metadata=_option(
            "AOT_TEXT_FP8",
            "FP8 weights in the text encoders' linear layers (torchao weight-only; any GPU), kept per encoder where"
            " its outputs stay close (its first blocks kept as they are if need be): on, off, or auto (on ZeroGPU,"
            " where every new worker moves the weights)",
            choices=("auto", "on", "off"),
        ),
    )
    cuda_graphs: str = field(
        default="auto",
        metadata=_option(
            "AOT_CUDA_GRAPHS",
            "replay each image size's transformer step as a CUDA graph, captured at its first step and checked"
            " against it; auto: on where CUDA is",
            choices=("auto", "on", "off"),
        ),
    )
    lora: str | None = field(
        default=None,
        metadata=_option(
            "AOT_LORA",
            "LoRAs fused into the transformer's weights at startup, before compiling: comma-separated"
            " [name=]source[:scale]; source a .safetensors file, a folder, or a Hub repo owner/name[/file.safetensors]",
        ),
    )
    lora_choices: str | None = field(
        default=None,
        metadata=_option(
            "AOT_LORA_CHOICES",
            "LoRAs a request can pick (UI and /generate's lora argument), written into the compiled blocks' weights"
            " in place when picked, no recompile; same syntax as --lora",
        ),
    )
    min_side: int = field(default=MIN_SIDE, metadata=_option("AOT_MIN_SIDE", "smallest image side in pixels", type=int))
    max_side: int = field(default=MAX_SIDE, metadata=_option("AOT_MAX_SIDE", "largest image side in pixels", type=int))
    load: str | None = field(
        default=None,
        metadata=_option(
            "AOT_LOAD",
            "load compiled packages from this folder or Hub repo (owner/name@commit pins it) instead of compiling;"
            " compile when they do not match",
        ),
    )
    save: str | None = field(default=None, metadata=_option("AOT_SAVE", "save the compiled packages into this folder"))
    push: str | None = field(
        default=None,
        metadata=_option("AOT_PUSH", "push the saved packages to this Hub repo id (token: HF_TOKEN) or folder"),
    )
    results_max_age: int = field(
        default=3600,
        metadata=_option(
            "AOT_RESULTS_MAX_AGE",
            "seconds a result image is kept in gradio's cache before it is deleted (gradio's delete_cache);"
            " results of earlier runs are deleted at start",
            type=int,
        ),
    )
    strict: bool = field(
        default=False,
        metadata=_option("AOT_STRICT", "raise instead of compiling when packages from --load cannot be used"),
    )
    device: str = field(
        default="auto", metadata=_option("AOT_DEVICE", "cuda, cuda:N, cpu, or auto (cuda when available)")
    )
    devices: str = field(
        default="auto",
        metadata=_option(
            "AOT_DEVICES",
            "serve one replica per device: auto (every visible GPU; the one --device names, if it names one)"
            " or a comma-separated list, e.g. cuda:0,cuda:1; ignored on ZeroGPU",
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=_option(
            "AOT_DTYPE",
            "weights dtype; auto: bfloat16 on CUDA, float32 on CPU",
            choices=("auto", "bfloat16", "float16", "float32"),
        ),
    )

    @classmethod
    def parser(cls, defaults: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
        """An argparse parser with one flag per field (`--min-side` for `min_side`); defaults unset.

        Args:
            defaults: field -> value that `from_env` gets with the same `defaults` (app.py's
                `MODEL_ID`, `MIN_SIDE`, `MAX_SIDE`), shown as the default in the help.
        """
        parser = argparse.ArgumentParser(add_help=False)
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            env, help_ = meta.pop("env"), meta.pop("help")
            flag = "--" + f.name.replace("_", "-")
            value = (defaults or {}).get(f.name, f.default)
            default = {None: "unset", "": "unset", True: "on", False: "off"}.get(value, value)
            help_ = f"{help_} (env {env}; default {default})"
            if f.type == "bool":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
            else:
                parser.add_argument(flag, default=None, help=help_, **meta)
        return parser

    @classmethod
    def from_env(
        cls,
        args: argparse.Namespace | None = None,
        environ: Mapping[str, str] | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> Options:
        """Options from parsed flags (`parser()`), then `environ` (default `os.environ`), then
        `defaults` (field -> value: app.py's own), then the fields' defaults below.

        Raises:
            ValueError: an environment variable holds a value its option does not allow.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = dict(defaults or {})
        for f in dataclasses.fields(cls):
            flag_value = getattr(args, f.name, None) if args is not None else None
            if flag_value is not None:
                values[f.name] = flag_value
            elif f.metadata["env"] in environ:
                values[f.name] = _parse_env(f, environ[f.metadata["env"]])
        return cls(**values)

    def resolution(self, vae_scale_factor: int) -> Resolution:
        """The sizes to compile for: `min_side..max_side`, pixel step 2 * `vae_scale_factor`
        (FLUX packs 2x2 latents; `pipe.vae_scale_factor` is 8 for FLUX.1 VAEs).

        Raises:
            ValueError: the bounds are not multiples of the step, min > max, or max > `LARGEST_SIDE`.
        """
        if self.max_side > LARGEST_SIDE:
            raise ValueError(f"max_side={self.max_side}: at most {LARGEST_SIDE} px (about 4 megapixels square)")
        return Resolution(self.min_side, self.max_side, step=2 * vae_scale_factor)

    @property
    def lora_specs(self) -> tuple[Any, ...]:
        """`lora`, parsed (`lora_specs.LoraSpec`s): the LoRAs fused into the weights at load."""
        return self._specs[0]

    @property
    def choice_specs(self) -> tuple[Any, ...]:
        """`lora_choices`, parsed (`lora_specs.LoraSpec`s): the LoRAs a request may pick."""
        return self._specs[1]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name}={getattr(self, f.name)!r}: allowed values are {', '.join(choices)}")
        if not re.fullmatch(r"auto|\d{1,2}\.\d", self.plan):
            raise ValueError(f"plan={self.plan!r}: use auto or a compute capability such as 12.0 or 9.0")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device={self.device!r}: use auto, cpu, cuda or cuda:N")
        if not re.fullmatch(r"auto|(cpu|cuda(:\d+)?)(,(cpu|cuda(:\d+)?))*", self.devices):
            raise ValueError(f"devices={self.devices!r}: use auto or a comma-separated list of cpu, cuda, cuda:N")
        # Parsed once here (raises ValueError naming the item and the syntax); `lora_specs`, `choice_specs`.
        object.__setattr__(self, "_specs", (tuple(parse(self.lora)), tuple(parse(self.lora_choices))))
        if self.results_max_age < 1:
            raise ValueError(f"results_max_age={self.results_max_age}: use a whole number of seconds, at least 1")
        if self.push and not self.save:
            raise ValueError(f"push={self.push!r} needs save: the folder whose packages are pushed (--save DIR)")


@contextlib.contextmanager
def usage_errors(parser: argparse.ArgumentParser, enabled: bool = True) -> Iterator[None]:
    """Inside, a setting that cannot work ends the program with `<prog>: error: <message>` and
    status 2, as argparse's own errors do, instead of a traceback that buries the message. Only
    errors our own checks raise (a ValueError, RuntimeError or OSError whose innermost frame is in
    this template's modules: a side range, a fast path this machine cannot run, an unreachable Hub,
    an unreadable LoRA); one raised inside a library (torch, diffusers) keeps its traceback, which
    finding that fault needs, and so does one carried from a ZeroGPU worker (`zerogpu.worker` adds
    the worker's traceback as a note). With `enabled` False (a module imported, not run) everything raises.
    """
    try:
        yield
    except (ValueError, RuntimeError, OSError) as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        ours = tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().parent in OURS
        if not enabled or not ours or getattr(exc, "__notes__", None):
            raise
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(exc).split())}\n")


# The template's own folders (the engine and the entry points above it): errors raised in their
# modules are its checks (`usage_errors`).
HERE = Path(__file__).resolve().parent
OURS = (HERE, HERE.parent)


def _parse_env(f: dataclasses.Field, raw: str) -> Any:
    env = f.metadata["env"]
    choices = f.metadata.get("choices")
    if choices and raw not in choices:
        raise ValueError(f"{env}={raw!r}: allowed values are {', '.join(choices)}")
    if f.type == "bool":
        if raw.lower() in ("1", "true", "on", "yes"):
            return True
        if raw.lower() in ("0", "false", "off", "no"):
            return False
        raise ValueError(f"{env}={raw!r}: use 1/0, true/false, on/off")
    if f.type == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{env}={raw!r}: expected an integer") from None
    return raw

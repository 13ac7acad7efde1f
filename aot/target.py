"""`Target`: what one pipeline is compiled for and served with, worked out once and handed on.

The family's row (families.py), the side range (`resolution.Resolution`) and the LoRAs (fused at load,
offered per request) follow from the pipeline and the options alone: compile.py's
`compile_transformer` works them out once per pipeline and hands them to the load path and the
compile path alike, and `server.Server` to the requests. What the GPU adds, the trials its plan
orders (`plans.Trials`), is worked out once in the startup's GPU call, where the real card is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aot.families import Family, family
from aot.lora_specs import LoraSpec
from aot.options import Options
from aot.resolution import Resolution


@dataclass(frozen=True)
class Target:
    """family: the pipeline class's row; resolution: the sides the packages are compiled for and
    the UI offers; loras: fused into the weights at load (`AOT_LORA`); choices: what a request may
    pick (`AOT_LORA_CHOICES`)."""

    family: Family
    resolution: Resolution
    loras: tuple[LoraSpec, ...]
    choices: tuple[LoraSpec, ...]

    @classmethod
    def of(cls, pipe: Any, options: Options) -> Target:
        """The target of `pipe` (a loaded diffusers pipeline) under `options`.

        Raises:
            ValueError: the pipeline class has no row in families.py; the side range does not fit
                the model's pixel step (`Options.resolution`).
        """
        resolution = options.resolution(pipe.vae_scale_factor)
        return cls(family(type(pipe).__name__), resolution, options.lora_specs, options.choice_specs)

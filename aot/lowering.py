"""What every package asks of Inductor, and the call that compiles one: `compile_package`.

Two changes from Inductor's defaults, each measured on FLUX.1-dev's compiled step (BENCHMARKS.md):
the settings in `INDUCTOR_CONFIGS` and one heuristic in `persistent_rows`.
"""

from __future__ import annotations

import functools
import os
import tempfile
import uuid
from typing import Any

import torch

# Inductor settings for every package. Weights stay out of the package: each block binds its own.
# No C++ build flag: the precompiled header is built ahead outside these (`portability.precompile_headers`).
INDUCTOR_CONFIGS: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
    # Store a pointwise result that is read more than once when it takes more than 16 ops,
    # instead of recomputing it in every kernel that reads it (Inductor's GPU default: 30). In
    # FLUX's single block the FP8 input of proj_out, cat(attention, gelu_tanh(mlp)), is read by the
    # row-amax and by the cast: one kernel instead of three (BENCHMARKS.md).
    "realize_opcount_threshold": 16,
}
# The widest row a reduction keeps in registers (`persistent_rows`): FLUX's 3072 features.
PERSISTENT_ROW_MAX = 4096
@functools.cache
def persistent_rows() -> Any:
    """Inductor's choices for every package, with one heuristic changed: a reduction along a row
    (`ReductionHint.INNER`) of a static width up to `PERSISTENT_ROW_MAX` is persistent, the whole row
    in one program's registers, read once; Inductor's own limit is 1024. The layer norms over 3072
    features and the row abs-max before FP8 GEMMs with 3072 inputs then read their rows once instead
    of in a loop. Every other reduction, a width known only at run time, and everything while
    `triton.persistent_reductions` is off get Inductor's own answer (`InductorChoices`).

    Measured on an H100 (BENCHMARKS.md, "Persistent row reductions"): Inductor's kernels outside
    attention and GEMMs took 1.2-1.4 ms less a step for FLUX.1-dev (of 23.1-23.6 ms) and FLUX.2 klein
    (of 9.2 ms). A limit of 16384, which takes in the single block's 15360-wide `proj_out` input, made
    that one kernel slower (8.72 against 6.92 ms a step).
    """
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint

    class PersistentRows(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features: Any, cooperative_reduction: bool) -> bool:
            width = features.reduction_numel
            if (
                config.triton.persistent_reductions  # Inductor's own off switch still turns them off
                and not cooperative_reduction
                and features.get_reduction_hint() == ReductionHint.INNER
                and width.is_number
                and int(width) <= PERSISTENT_ROW_MAX
            ):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

    return PersistentRows()


def compile_package(exported: torch.export.ExportedProgram) -> bytes:
    """AOTInductor-compile `exported` into a weights-less `.pt2` package; returns its bytes.

    Its generated files get a name of their own (`aot_inductor.model_name_for_generated_files`), not
    their code's hash: Inductor holds a file lock named after it through the C++ build, and the next
    class compiles inside that build (`overlap.overlapped`). Two classes with the same code (Z-Image's
    refiners and layers can be) would wait on each other's lock for ever.
    """
    from torch._inductor.virtualized import V

    settings = {**INDUCTOR_CONFIGS, "aot_inductor.model_name_for_generated_files": f"block_{uuid.uuid4().hex}"}
    with tempfile.TemporaryDirectory() as tmp, V.set_choices_handler(persistent_rows()):
        path = os.path.join(tmp, "package.pt2")
        torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=settings)
        with open(path, "rb") as f:
            return f.read()

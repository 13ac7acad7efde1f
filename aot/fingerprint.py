"""What a set of packages is valid for (its fingerprint), the variant name that keeps sets compiled
for other choices apart, and what differs between a saved fingerprint and this machine's.

The fingerprint records library versions, CPU architecture, CUDA and compute capability, dtype, size
range, attention and FP8 choices, and per block class its forward signature and weight names,
shapes and dtypes; a compile adds the vector extensions and runtime library versions its C++ needs
(portability.py). A package is used only when every field matches here.
"""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any

import torch

from aot import portability
from aot.blocks import forward_signature, repeated_blocks
from aot.contract import dtype_name
from aot.resolution import Resolution

# 3: contracts give each dynamic dim as image and text coefficients (contract.TensorSpec); 4: fp8 is the
# granularity the GPU's plan kept (`options.FP8_GRANULARITIES`) or "off", per package and for the set;
# 5: `row-after` packages bind each layer's unit scale and bf16 column scales (`fp8.RowScalesAfterGEMM`),
# which blocks quantized by earlier code lack (a field of the unquantized blocks cannot tell).
SCHEMA = 5


def fingerprint(
    transformer: torch.nn.Module,
    resolution: Resolution,
    attention: str,
    fp8: str,
    fa3_kernel: str | None,
    ours: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """What packages compiled for `transformer` are valid for (JSON-able): `attention` the kernel
    ("fa3", "fa3-fp8", "sage", "sdpa"), `fp8` the granularity (`options.FP8_GRANULARITIES`) or "off", `fa3_kernel`
    where FA3 is loaded from (None unless `attention` calls FA3), `ours` the kernels of ours the packages
    compute with (`plans.Trials.ours`): "norm_rope" "on" or "off", and "row_fp8": "on" where it is one."""
    import diffusers  # heavy: at first use
    import torchao  # heavy: at first use

    device = transformer.device
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        device_name = f"cuda sm_{major}{minor}"
    else:
        device_name = device.type
    blocks = repeated_blocks(transformer)
    return {
        "schema": SCHEMA,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchao": torchao.__version__,
        "diffusers": diffusers.__version__,
        "kernels": importlib.metadata.version("kernels"),
        "device": device_name,
        # Each package holds C++ for this architecture; `compile_blocks` adds what it needs of the
        # CPU ("cpu_isa", portability.isa_built_for) and of the runtime libraries ("glibc", "glibcxx":
        # portability.runtimes_needed).
        "machine": platform.machine(),
        "dtype": dtype_name(transformer.dtype),
        "sizes": [resolution.min_side, resolution.max_side, resolution.step],
        "attention": attention,
        "fa3_kernel": fa3_kernel,
        "fp8": fp8,  # the granularity, or off
        "norm_rope": "on" if "norm_rope" in ours else "off",
        **({"row_fp8": "on"} if "row_fp8" in ours else {}),  # only where on: packages saved before it still match
        "blocks": {
            name: {
                "count": len(found),
                "forward": str(forward_signature(found[0])),
                "weights": [[n, list(t.shape), dtype_name(t.dtype)] for n, t in found[0].state_dict().items()],
            }
            for name, found in blocks.items()
        },
    }


def variant(fp: dict[str, Any]) -> str:
    """`fa3-fp8row-512-1536`, `fa3-fp8-fp8row-normrope-512-1536`, `sdpa-bfloat16-512-1536`, ...: the choices
    that change the graph (attention, FP8 or dtype, the kernels of ours, side range), so sets compiled for
    other choices live side by side."""
    precision = "fp8" + fp["fp8"] if fp["fp8"] != "off" else fp["dtype"]
    kernel = "-normrope" * (fp.get("norm_rope") == "on") + "-rowfp8" * (fp.get("row_fp8") == "on")
    return f"{fp['attention']}-{precision}{kernel}-{fp['sizes'][0]}-{fp['sizes'][1]}"


def differences(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Human-readable fingerprint differences, e.g. `torch: 2.11.0 (packages) vs 2.13.0 (here)`."""
    out = []
    for key in sorted(set(saved) | set(here)):
        # the packages' needs are checked apart: portability.isa_problem, runtime_problem
        if key in ("blocks", "cpu_isa", *portability.RUNTIMES):
            continue
        if saved.get(key) != here.get(key):
            out.append(f"{key}: {saved.get(key)} (packages) vs {here.get(key)} (here)")
    blocks_saved, blocks_here = saved.get("blocks", {}), here.get("blocks", {})
    for name in sorted(set(blocks_saved) | set(blocks_here)):
        a, b = blocks_saved.get(name), blocks_here.get(name)
        if a is None or b is None:
            out.append(f"block class {name}: {'missing from the packages' if a is None else 'not in this model'}")
            continue
        for field in ("count", "forward", "weights"):
            if a[field] != b[field]:
                detail = _first_weight_difference(a, b) if field == "weights" else f"{a[field]} vs {b[field]}"
                out.append(f"{name} {field} differ: {detail}")
    return out


def _first_weight_difference(a: dict, b: dict) -> str:
    saved, here = {w[0]: w[1:] for w in a["weights"]}, {w[0]: w[1:] for w in b["weights"]}
    for name in sorted(set(saved) | set(here)):
        if saved.get(name) != here.get(name):
            return f"{name} is {saved.get(name)} in the packages, {here.get(name)} here"
    return "order differs"

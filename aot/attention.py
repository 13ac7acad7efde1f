"""The attention kernels a block is exported with, one name each, and what each block calls.

`sdpa`: torch's scaled_dot_product_attention (diffusers' `native` backend), any GPU. `fa3`, `fa3-fp8`:
FlashAttention-3 in bf16 or on FP8 inputs, Hopper only (fa3.py). `sage`: INT8 Q·K^T and FP8 P·V in
Triton, where FP8 tensor cores are (sage.py). `attention_backend(kernel)` makes diffusers' dispatcher
call the kernel while a block is exported or run eager; `attention_op(kernel)` is the op the exported
graph must call, which export.py checks; `ms_per_call` and `speed_note` keep a kernel whose gain
depends on the GPU only where it is faster there.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from aot.fa3 import fa3_attention, fp8_attention
from aot.sage import quantized, sage_attention, sage_forward

# The kernels that round Q, K, V or P below bf16: each block is held to the FP8 blocks' error bound,
# and each class's first block is checked eager before any compile (export.py's `_attention_note`).
LOW_PRECISION = ("fa3-fp8", "sage")


@contextlib.contextmanager
def attention_backend(kernel: str) -> Iterator[None]:
    """Inside, diffusers' attention dispatcher runs `kernel` ("sdpa", "fa3", "fa3-fp8", "sage"): what a
    block exported inside calls. `fa3_attention` (`fa3`) or `fp8_attention` (`fa3-fp8`) takes the
    `_flash_3` backend's place in diffusers' registry while inside, `sage_attention` the `native`
    backend's (diffusers has no name for any of them)."""
    from diffusers.models import attention_dispatch  # heavy: at first use

    name = {"sdpa": "native", "fa3": "_flash_3", "fa3-fp8": "_flash_3", "sage": "native"}[kernel]
    wrap = {
        "fa3": lambda flash_3: functools.partial(fa3_attention, flash_3),
        "fa3-fp8": lambda _: fp8_attention,
        "sage": lambda _: sage_attention,
    }
    swap = replaced_backend(name, wrap[kernel]) if kernel in wrap else contextlib.nullcontext()
    with swap, attention_dispatch.attention_backend(name):
        yield


@contextlib.contextmanager
def replaced_backend(name: str, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """Inside, diffusers' attention registry holds `wrap(original)` in place of backend `name` (an
    `AttentionBackendName` value: "_flash_3", "native"), `original` the function it held; put back
    on the way out, an exception included."""
    from diffusers.models import attention_dispatch  # heavy: at first use

    registry, backend = attention_dispatch._AttentionBackendRegistry, attention_dispatch.AttentionBackendName(name)
    original = registry._backends[backend]
    registry._backends[backend] = wrap(original)
    try:
        yield
    finally:
        registry._backends[backend] = original


def attention_op(kernel: str) -> Any:
    """The op a block exported under `kernel` ("fa3", "fa3-fp8", "sage") calls for its attention;
    None for `sdpa` (torch's own op, whichever kernel it picks)."""
    if kernel == "sdpa":
        return None
    if kernel == "fa3-fp8":
        return torch.ops.aot_fa3.fp8_forward.default
    if kernel == "sage":
        return torch.ops.aot_sage.forward.default
    import diffusers.models.attention_dispatch  # noqa: F401  # heavy: at first use; registers the op

    return torch.ops._diffusers_flash_attn_3._flash_attn_forward.default


# A kernel whose gain depends on the GPU (`TIMED`) is kept only where its op beats SDPA at the blocks'
# own shapes by this factor: the quantization passes a package runs around `sage` cost 13% of its
# kernel's time in a FLUX.1-dev step on an H100 (3.5 of 26.3 ms; BENCHMARKS.md).
MIN_GAIN = 1.15
TIMED = ("sage",)


@contextlib.contextmanager
def recorded_shapes() -> Iterator[set[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Inside, diffusers' dispatcher runs SDPA and records each call's (query shape, key shape),
    (batch, seq, heads, head_dim): the attention calls a block makes."""
    from diffusers.models import attention_dispatch  # heavy: at first use

    shapes: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()

    def recording(native: Callable[..., Any]) -> Callable[..., Any]:
        def record(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
            shapes.add((tuple(query.shape), tuple(key.shape)))
            return native(query=query, key=key, value=value, **kwargs)

        return record

    with replaced_backend("native", recording), attention_dispatch.attention_backend("native"):
        yield shapes


def ms_per_call(kernel: str, shapes: set[tuple[tuple[int, ...], tuple[int, ...]]], device: torch.device) -> float:
    """Milliseconds `kernel`'s attention takes for one call at each of `shapes` ((query shape, key
    shape), as `recorded_shapes` gives them), summed: `sage` its op on inputs already quantized
    (the package fuses the quantization into the kernels before it), `sdpa` torch's SDPA in bf16.
    Random inputs: the kernels' time does not depend on the values. CUDA events, 10 calls after 3.

    Raises:
        ValueError: no shapes (nothing to time).
    """
    if not shapes:
        raise ValueError("no attention calls to time")
    total = 0.0
    for q_shape, k_shape in sorted(shapes):
        q = torch.randn(q_shape, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(k_shape, device=device, dtype=torch.bfloat16) for _ in range(2))
        if kernel == "sage":
            call = functools.partial(sage_forward, *quantized(q, k, v, None))
        else:
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            sdpa, grouped = torch.nn.functional.scaled_dot_product_attention, q_shape[2] != k_shape[2]
            call = functools.partial(sdpa, qt, kt, vt, enable_gqa=grouped)
        for _ in range(3):
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            call()
        end.record()
        end.synchronize()
        total += start.elapsed_time(end) / 10
    return total


def speed_note(kernel: str, kernel_ms: float, sdpa_ms: float) -> str:
    """What the attention decision says of `kernel`'s timing against SDPA's (`ms_per_call`).

    Raises:
        RuntimeError: `kernel` is not `MIN_GAIN` times faster than SDPA.
    """
    said = f"{kernel_ms:.3f} ms a call against SDPA's {sdpa_ms:.3f} ms"
    if not kernel_ms * MIN_GAIN <= sdpa_ms:
        raise RuntimeError(f"{kernel}: {said}, not {MIN_GAIN}x faster")
    return said

"""ZeroGPU's facts, as constants: whether this process is on it, and the limits of its GPU calls.

A leaf: it imports nothing of the engine, so that every module may read it (zerogpu.py is the
adapter that hands work to a GPU; docs/zerogpu.md says what runs where).
"""

from __future__ import annotations

from spaces.config import Config

ON_ZEROGPU: bool = Config.zero_gpu  # SPACES_ZERO_GPU=1/t/true, read by spaces at import
# Above this many bytes packed at launch spaces makes `xlarge` its default size (`xlarge_threshold` of
# the RTX Pro 6000 entry in spaces 0.51.3's zero/configs.json: 42 GiB of the half card's 48 GB).
LARGE_MAX_BYTES = 45_097_156_608


def size_advice(moved: int, size: str | None) -> tuple[str, bool]:
    """One line on `moved` bytes of weights under app.py's `GPU_SIZE=size`, and whether it is a warning.

    None (spaces' default) becomes `xlarge` (twice the quota) past `LARGE_MAX_BYTES`, an explicit `large` may not
    hold them, and `xlarge` below it takes the whole card for nothing.

    Args:
        moved: bytes a new worker moves to the GPU (every weight of the pipeline).
        size: None (spaces' default), `large` or `xlarge` (app.py's `GPU_SIZE`).
    """
    amount = f"{moved / 1e9:.1f} GB" if moved >= 1e8 else f"{moved / 1e6:.3f} MB"
    line, limit = f"a new ZeroGPU worker moves {amount} of weights to the GPU", f"{LARGE_MAX_BYTES / 2**30:.0f} GiB"
    if moved <= LARGE_MAX_BYTES:
        if size == "xlarge":
            return f"{line}: large would hold them; GPU_SIZE='xlarge' takes the whole card at twice the quota", True
        return f"{line}: fits large (spaces keeps large up to {limit} packed)", False
    if size is None:
        return f"{line}, over {limit}: spaces runs every GPU call on xlarge (the whole card, twice the quota)", True
    if size == "large":
        return f"{line}, over {limit}: GPU_SIZE='large' (48 GB) may not hold them; use None or 'xlarge'", True
    return f"{line}, over {limit}: xlarge", False

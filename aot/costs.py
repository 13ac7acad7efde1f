"""What this process has spent on work only compiled blocks do, counted so that each ZeroGPU call's
log line says what it spent (registered with the adapter: `zerogpu.count_per_call`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from aot import zerogpu


@dataclass
class Costs:
    """What this process has spent on work only compiled blocks do: package loads, binds (a block's
    pointers set before it runs), CUDA graph captures and their check replays (graphs.py), counts
    and seconds. A new ZeroGPU worker pays them once; its `zerogpu-call` lines say what each call spent."""

    loads: int = 0
    load_s: float = 0.0
    binds: int = 0
    bind_s: float = 0.0
    captures: int = 0
    capture_s: float = 0.0
    checks: int = 0
    check_s: float = 0.0

    def add(self, what: str, seconds: float) -> None:
        setattr(self, f"{what}s", getattr(self, f"{what}s") + 1)
        setattr(self, f"{what}_s", getattr(self, f"{what}_s") + seconds)


COSTS = Costs()
zerogpu.count_per_call("compiled blocks", lambda: dataclasses.asdict(COSTS))

"""A switch that is on only for the thread inside it, and nests: `ThreadFlag`. Inductor's code generation
is process-wide, while a compile runs on one thread beside others (`overlap.overlapped` compiles the next
block class on another thread; a user's `torch.compile` may run beside); what a package asks of Inductor
beyond its settings (`lowering.native_min_max`, `shared_inputs.shared_exact_inputs`) holds on the
compiling thread alone."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class ThreadFlag:
    """`on` is True on a thread inside `entered()`, False elsewhere."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def on(self) -> bool:
        return getattr(self._local, "on", False)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """On for this thread while inside. Nests; an error leaves it as entered."""
        outer = self.on
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = outer

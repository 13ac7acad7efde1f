"""One replica of the pipeline per GPU: the devices to serve from, and which replica is free.

    python app.py                                  # AOT_DEVICES=auto: every visible GPU
    AOT_DEVICES=cuda:0,cuda:2 python app.py        # these GPUs
    AOT_DEVICES=cpu,cpu python app.py              # two CPU replicas (how the tests run it)

Each replica is a pipeline on its own device, with its own weights, block runners and CUDA graphs.
Packages are weights-less, so the first replica of each GPU model (name and compute capability,
`gpu_model`) loads or compiles them and the others bind the same ones (app.py's `start`). Requests take a free replica
(`Replicas.take`); Gradio's queue runs one request per replica at once. On a machine with one GPU
there is one replica and nothing else changes. On ZeroGPU there is one replica too, but requests
are not held to it: each GPU call runs in a forked worker with its own copy of the pipeline, and
ZeroGPU schedules those calls itself (`Replicas.concurrency`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
from collections.abc import Iterator
from typing import Any

import torch

from aot import lora
from aot.options import Options
from aot.pipeline import load_pipeline
from aot.zerogpu_limits import ON_ZEROGPU

log = logging.getLogger("replicas")


def devices(options: Options) -> list[str]:
    """The devices to serve from: `options.devices` as a list, or for `auto` every visible CUDA GPU
    (`options.device` alone when it names one, or without CUDA). On ZeroGPU `options.device` alone:
    `options.devices` is ignored there (each GPU call's worker gets one GPU; `Replicas.take`)."""
    if ON_ZEROGPU:
        return [options.device]
    if options.devices != "auto":
        return options.devices.split(",")
    if options.device != "auto" or not torch.cuda.is_available():
        return [options.device]
    return [f"cuda:{index}" for index in range(torch.cuda.device_count())]


def gpu_model(device: str | torch.device) -> str:
    """What packages are specific to: the GPU's name and compute capability, or the device type."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return f"{torch.cuda.get_device_name(device)} sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"


# Behind the 40 requests gradio runs at once (each in ZeroGPU's queue, 60 s at most) 20 wait; more are refused at once.
ZEROGPU_MAX_WAITING = 20


class Replicas:
    """The pipelines, one per device, their LoRA choices (`lora.Adapters`, one per pipeline), and
    which of them are free. `len()` is how many pipelines there are, `concurrency` how many
    requests may run at once; `zerogpu` says the pipelines are served by ZeroGPU's forked workers."""

    def __init__(self, pipes: list[Any], adapters: list[lora.Adapters]):
        self.pipes, self.adapters = pipes, adapters
        self.zerogpu = ON_ZEROGPU
        self._free: queue.Queue[int] = queue.Queue()
        for index in range(len(pipes)):
            self._free.put(index)

    def __len__(self) -> int:
        return len(self.pipes)

    @property
    def concurrency(self) -> int | None:
        """How many requests may run at once (gradio's `default_concurrency_limit`); None: no cap.

        One per replica, except on ZeroGPU, where the platform schedules: each `@spaces.GPU` call
        runs in a worker forked from the main process, with its own copy of the pipeline (the main
        process's emulated CUDA tensors never compute), so concurrent requests share no pipeline
        state. ZeroGPU grants as many calls at once as it has GPUs for the Space and queues
        the rest itself; a cap here would only keep visitors from reaching that queue.
        """
        return None if self.zerogpu else len(self.pipes)

    @property
    def max_waiting(self) -> int | None:
        """Gradio's waiting-queue size (`demo.queue(max_size=...)`): unbounded (gradio's default)
        except on ZeroGPU, where gradio would otherwise make it 1 (`ZEROGPU_MAX_WAITING`)."""
        return ZEROGPU_MAX_WAITING if self.zerogpu else None

    @contextlib.contextmanager
    def take(self) -> Iterator[int]:
        """Wait for a free replica; yields its index and frees it afterwards (also on an error).

        On ZeroGPU it yields replica 0 (the only one) at once and never waits: the GPU call runs
        in a worker of its own (`concurrency`), so requests do not take turns on the replica.
        """
        if self.zerogpu:
            yield 0
            return
        index = self._free.get()
        try:
            yield index
        finally:
            self._free.put(index)


def load_pipelines(options: Options) -> list[Any]:
    """One pipeline per serving device (`devices`), each loaded by `pipeline.load_pipeline` with
    `options` on its own device.

    Raises:
        RuntimeError, ValueError, OSError: see `pipeline.load_pipeline`.
    """
    chosen = devices(options)
    pipes = [load_pipeline(dataclasses.replace(options, device=device, devices="auto")) for device in chosen]
    if len(pipes) > 1:
        models = {gpu_model(device) for device in chosen}
        log.info("%d replicas on %s; packages for %d GPU model(s)", len(chosen), ", ".join(chosen), len(models))
    return pipes

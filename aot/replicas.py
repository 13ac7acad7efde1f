"""One replica of the pipeline per GPU: compile once per GPU model, bind the packages on every GPU.

    python app.py                                  # AOT_DEVICES=auto: every visible GPU
    AOT_DEVICES=cuda:0,cuda:2 python app.py        # these GPUs
    AOT_DEVICES=cpu,cpu python app.py              # two CPU replicas (how the tests run it)

Each replica is a pipeline on its own device, with its own weights, block runners and CUDA graphs.
Packages are weights-less, so the first replica of each GPU model (name and compute capability)
loads or compiles them and the others bind the same ones. Requests take a free replica
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
from aot.blocks import Compiled, Report
from aot.optimize import optimize_
from aot.options import Options
from aot.pipeline import load_pipeline
from aot.target import Target

log = logging.getLogger("replicas")


def devices(options: Options) -> list[str]:
    """The devices to serve from: `options.devices` as a list, or for `auto` every visible CUDA GPU
    (`options.device` alone when it names one, or without CUDA). On ZeroGPU `options.device` alone:
    `options.devices` is ignored there (each GPU call's worker gets one GPU; `Replicas.take`)."""
    from aot.zerogpu import ON_ZEROGPU

    if ON_ZEROGPU:
        return [options.device]
    if options.devices != "auto":
        return options.devices.split(",")
    if options.device != "auto" or not torch.cuda.is_available():
        return [options.device]
    return [f"cuda:{index}" for index in range(torch.cuda.device_count())]


def gpu_model(device: str) -> str:
    """What packages are specific to: the GPU's name and compute capability, or the device type."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return f"{torch.cuda.get_device_name(device)} sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"


# Behind the 40 requests gradio runs at once (each in ZeroGPU's queue, 60 s at most) 20 wait; more are refused at once.
ZEROGPU_MAX_WAITING = 20


class Replicas:
    """The pipelines, one per device, their LoRA choices (`lora.Adapters`, one per pipeline), their
    targets (`target.Target`), and which of them are free. `len()` is how many pipelines there are,
    `concurrency` how many requests may run at once; `zerogpu` says the pipelines are served by
    ZeroGPU's forked workers."""

    def __init__(
        self, pipes: list[Any], reports: list[Report | None], adapters: list[lora.Adapters], targets: list[Target]
    ):
        from aot.zerogpu import ON_ZEROGPU

        self.pipes, self.reports, self.adapters, self.targets = pipes, reports, adapters, targets
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


def start(options: Options, pipe: Any = None) -> Replicas:
    """Load one pipeline per device and, with `options.compile`, optimize each (`optimize.optimize_`):
    the first of each GPU model loads or compiles packages, the others bind them. Each pipeline
    gets the LoRAs of `options.lora_choices` as `lora.Adapters`. With `pipe` (a tool's own
    pipeline, e.g. tools/bench.py's random FLUX.1-dev) that one pipeline is the only replica.

    Raises:
        RuntimeError, ValueError, OSError: see `pipeline.load_pipeline`, `optimize.optimize_` and
            `lora.read`.
    """
    given = pipe
    chosen = devices(options) if given is None else [options.device]
    pipes, reports, adapters, targets = [], [], [], []
    compiled: dict[str, Compiled] = {}  # GPU model -> packages
    for device in chosen:
        replica = dataclasses.replace(options, device=device, devices="auto")
        pipe = load_pipeline(replica) if given is None else given
        target = Target.of(pipe, replica)  # worked out once per pipeline, handed to everything below
        report = None
        if options.compile:
            model = gpu_model(device) if len(chosen) > 1 else ""  # one replica: no CUDA query (ZeroGPU)
            if model in compiled:  # bind the packages; they were saved and pushed once already
                replica = dataclasses.replace(replica, save=None, push=None)
            report = optimize_(pipe, replica, compiled=compiled.get(model), target=target)
            compiled.setdefault(model, report.compiled)
        fp8 = report.compiled.fp8_config if report else None
        if adapters:  # the LoRAs are read once, by the first replica's adapters
            adapters.append(adapters[0].for_pipeline(pipe, fp8))
        else:
            adapters.append(lora.Adapters(pipe, list(target.choices), fp8))
        pipes.append(pipe)
        reports.append(report)
        targets.append(target)
    if len(chosen) > 1:
        log.info("%d replicas on %s; packages for %d GPU model(s)", len(chosen), ", ".join(chosen), len(compiled))
    return Replicas(pipes, reports, adapters, targets)

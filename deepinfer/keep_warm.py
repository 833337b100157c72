"""Keeps the compute threads' cores awake while a step runs (``layers/csrc/keep_warm.cpp``).

A step of a batched decode runs a few hundred short parallel regions; under the passive wait
policy (``threads.py``) each one wakes a sleeping OpenMP worker, and where its core went idle
(a VM's halted vCPU above all) the region waits for that wake-up longer than its own work takes.
During a step one SCHED_IDLE thread per worker polls, so no worker core idles; any other thread
(a worker, another process) preempts it at once, so it takes no time anybody else wants. One
thread has no workers to wake: nothing starts. ``DEEPINFER_NO_KEEP_WARM=1`` switches it off.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from .native_build import NativeExtension, build_extension

SOURCE = Path(__file__).parent / "layers" / "csrc" / "keep_warm.cpp"
STEM = "deepinfer_keep_warm"
DISABLE_ENV = "DEEPINFER_NO_KEEP_WARM"


@cache
def keep_warm_kernel() -> NativeExtension:
    """Build (once per machine) and load the warmers; never raises."""
    return build_extension(STEM, SOURCE, lambda: torch.ops.deepinfer_warm.isa())


class CoreWarmer:
    """Polls the worker cores of ``threads`` compute threads while ``during()`` is open; a no-op
    for one thread, off the CPU, when switched off or when the source did not build."""

    def __init__(self, threads: int, device: torch.device) -> None:
        self.enabled = (threads > 1 and device.type == "cpu" and os.environ.get(DISABLE_ENV, "") in ("", "0")
                        and keep_warm_kernel().loaded)
        if self.enabled:
            torch.ops.deepinfer_warm.start(threads - 1)

    @contextmanager
    def during(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        torch.ops.deepinfer_warm.begin()
        try:
            yield
        finally:
            torch.ops.deepinfer_warm.end()

"""Wall time per named stage of a training step (timing_s/*), each stage also a profiler range."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from . import ranges


class StageTimer:
    """Wall time per named stage, accumulated over a step (a stage may run several times: refills). In a
    profiled step each stage is also a named range (flashdapo/profiling/ranges.py: torch.profiler, NVTX)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.running: list[tuple[str, float]] = []
        """The stages running now, outermost first, with their start times (read by the heartbeat)."""

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self.running.append((name, start))
        try:
            with ranges.named(name):
                yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # deliberate: stage times must include queued GPU work
            self.seconds[name] += time.perf_counter() - start
            self.running.pop()

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


__all__ = ["StageTimer"]

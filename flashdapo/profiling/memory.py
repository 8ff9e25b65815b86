"""Memory of a profiled step: the peak resident set of each range on a CPU, the allocator's history on CUDA.

CPU: Linux keeps the process's peak resident set (VmHWM in /proc/self/status) and resets it to the current
resident set when "5" is written to /proc/self/clear_refs. `RssPeaks` resets it as each range opens and
reads it as it closes, folding the peak into the ranges around it, so that nested ranges each get their own
peak. Where the reset is refused (not Linux, a restricted /proc) the peak is the process's so far.

CUDA: `torch.cuda.memory._record_memory_history` over the step, dumped as a snapshot pickle that
https://pytorch.org/memory_viz draws (every allocation with its stack, over time).
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
MAX_HISTORY_ENTRIES = 100_000
"""Allocator events a CUDA snapshot keeps (the newest): bounded, as a long step's history grows with it."""


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """The resident set's peak since the last reset (VmHWM), else the process's (getrusage)."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssPeaks:
    """Peak resident set per nested range (see the module docstring)."""

    def __init__(self):
        self._open: list[int] = []
        """Per open range, outermost first: the largest resident set seen in it so far."""
        self.resets = _reset_peak()
        """Whether this system resets the peak (else each range reports the process's peak so far)."""

    def _fold(self) -> int:
        peak = peak_rss_bytes()
        self._open = [max(p, peak) for p in self._open]
        return peak

    def enter(self) -> None:
        self._fold()
        if self.resets:
            _reset_peak()
        self._open.append(peak_rss_bytes())

    def exit(self) -> int:
        """Close the innermost range; its peak resident set in bytes."""
        self._fold()
        return self._open.pop()


class CudaMemoryHistory:
    """The CUDA allocator's history over one profiled step, written as a snapshot pickle."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> CudaMemoryHistory:
        torch.cuda.memory._record_memory_history(max_entries=MAX_HISTORY_ENTRIES)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            torch.cuda.memory._dump_snapshot(str(self.path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

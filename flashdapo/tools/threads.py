"""CPU threads: how many intra-op threads a run uses, chosen from the model size and the machine.

Why this matters. torch runs each operator's loop on its OpenMP threads, which meet at a barrier at
the end of the operator. With OpenMP's default wait policy, a thread that arrives first spins; when a
competing process holds the core its sibling needs, every operator waits for a time slice of that
sibling while the spinning thread burns the other core. On a 2-core machine with one CPU-bound
competitor, the toy demo's steps went from 0.25 s to 1-2.7 s this way, far more than the 2x that
sharing the cores explains. Two measures:

- `OMP_WAIT_POLICY=PASSIVE` (set by the command line before torch loads; a value already in the
  environment wins): idle OpenMP threads sleep at once instead of spinning.
- One intra-op thread for models under `SMALL_MODEL_PARAMS` parameters: their matmuls are too small
  to split (microseconds each), so a second thread only adds a barrier per operator; with one thread
  there is none, and a competitor costs at most its share of the cores. Larger models use every CPU
  this process may run on.

`OMP_NUM_THREADS` in the environment (torchrun sets 1 per rank when it starts several) is respected:
nothing is changed then. On CUDA nothing is changed either (the host threads only launch kernels).
"""

from __future__ import annotations

import os

import torch

SMALL_MODEL_PARAMS = 1_000_000
"""Below this many parameters (per rank) a model runs on one intra-op thread."""


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask; the CPU count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_threads(num_params: int, cpus: int) -> int:
    """Intra-op threads for a model of `num_params` parameters on `cpus` CPUs."""
    return 1 if num_params < SMALL_MODEL_PARAMS else max(cpus, 1)


def configure_threads(num_params: int, device: torch.device) -> int | None:
    """Set torch's intra-op threads for this model on this machine; returns the count set, or None when
    the environment (OMP_NUM_THREADS) or the device (CUDA) decides instead."""
    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = choose_threads(num_params, available_cpus())
    torch.set_num_threads(threads)
    return threads


__all__ = ["SMALL_MODEL_PARAMS", "available_cpus", "choose_threads", "configure_threads"]

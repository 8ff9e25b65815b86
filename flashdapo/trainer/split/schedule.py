"""Split placement's strict schedule (docs/split.md): which weights generate which batch.

Trainer step s starts from θ_(s-1) and produces θ_s; batch s trains at step s. With rollout.max_lag = k,
batch b is generated with θ_(b-1-k): no fresher and no older, whatever the timing, so every token's lag
(s - 1 minus the step of the weights that sampled it) is a function of the seed, the data and k alone. The
first k batches of a run sample the starting weights (their lag is b - 1 < k). An informative group kept past
a batch's target opens the next batch and keeps its own version: its lag there is one more.
"""

from __future__ import annotations

START_KEY = "start"
"""The store key trainer rank 0 writes once its run is set up: {"start": step, "total": total_steps}."""


def weights_step(batch: int, max_lag: int, start: int = 0) -> int:
    """The trainer step whose weights generate `batch`: b - 1 - k, never before the start."""
    return max(start, batch - 1 - max_lag)


def last_pushed_step(total_steps: int, max_lag: int, start: int = 0) -> int:
    """The newest step whose weights some batch up to total_steps needs (the trainer pushes no later one)."""
    return weights_step(total_steps, max_lag, start)


def expected_lag(step: int, max_lag: int, start: int = 0) -> int:
    """The lag of the fresh tokens trained at `step` (groups carried from an earlier batch are older)."""
    return step - 1 - weights_step(step, max_lag, start)


__all__ = ["START_KEY", "expected_lag", "last_pushed_step", "weights_step"]

"""Rollout engines: a plain torch engine (any device) and a co-located vLLM engine (GPU, lazy import)."""

from .base import (
    Completion,
    Request,
    RolloutEngine,
    Rollouts,
    SamplingParams,
    StreamingEngine,
    WeightSource,
    sampling_params,
)

__all__ = [
    "Completion", "Request", "RolloutEngine", "Rollouts", "SamplingParams", "StreamingEngine", "WeightSource",
    "sampling_params"
]

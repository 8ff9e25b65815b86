"""Rollout engines: a plain torch engine (any device) and a co-located vLLM engine (GPU, lazy import)."""

from .base import RolloutEngine, Rollouts, SamplingParams, WeightSource, derive_seed

__all__ = ["RolloutEngine", "Rollouts", "SamplingParams", "WeightSource", "derive_seed"]

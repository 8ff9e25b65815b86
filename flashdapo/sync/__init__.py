"""Weights on their way from the trainer's shards to a sampler: one room for every path they take.

- `WeightSource` (here): the policy's full HF-named tensors, gathered from the FSDP2 shards one at a time
  (models/weights.py), with the version an engine's `wake` is given; what the co-located engines wake on, what
  split placement's rollout side wakes its engine on (its own copy), and what the HF export writes.
- `vllm.py`: the push into a running vLLM (its layerwise reload, the names its loaders take, completeness),
  and where vLLM's forward parts from the trainer's after a failed check.
- `check.py`: the push check (`PushCheck`), its calibration and fp32 reference log-probs, for any engine
  holding its own copy of the weights.
- `broadcast.py`: split placement's push, trainer rank 0 to the rollout ranks over a bridge, in buckets.

A push crosses: the trainer (the step's end) -> the rollout engine's `wake` -> `WeightSource` (models' gather)
-> sync/vllm.py's reload -> sync/check.py's probe (models' forward). The engines themselves live in rollout/,
which imports this package; it imports models/ and below, nothing of rollout/ or trainer/.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..models.weights import iter_full_state_dict

__all__ = ["WeightSource", "policy_weights"]


@dataclass
class WeightSource:
    """The policy's weights as full HF-named tensors, one at a time (every rank together: each tensor is an
    FSDP2 all-gather), and their version. Called with a dtype it is the `weights(dtype)` an engine's `wake`
    streams (rollout/base.py); `export()` gives the tensors the HF export writes."""

    hf: nn.Module
    """The policy's HF model (sharded or not)."""
    export_dtype: torch.dtype | None = None
    """The dtype of the export's tensors (the compute dtype: bf16 for model.dtype bfloat16); None: as held."""
    version: int = 0
    """Optimizer updates so far in this process: the version the engine's `wake` is given with the weights."""

    def __call__(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors cast to `dtype` (None: as held), for an engine's `wake`."""
        return iter_full_state_dict(self.hf, dtype=dtype)

    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors in `export_dtype`, for the HF export (config.json says that dtype)."""
        return iter_full_state_dict(self.hf, dtype=self.export_dtype)

    def wake(self, engine) -> None:
        """Make `engine` sample these weights at this version (vLLM: the push, checked; the torch engine: the
        gather it samples from; either skips a version it already holds)."""
        engine.wake(self, self.version)

    def advance(self) -> None:
        """One more optimizer update: the next `wake` pushes again."""
        self.version += 1


def policy_weights(hf: nn.Module, model_dtype: str) -> WeightSource:
    """The WeightSource of a policy trained in model.dtype `model_dtype` (resolved: bfloat16 or float32)."""
    return WeightSource(hf, torch.bfloat16 if model_dtype == "bfloat16" else None)

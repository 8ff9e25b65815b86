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

from ..errors import FlashdapoError
from ..models.lora import AdapterLayout, base_name, is_adapter, layout_of, merged_stream, peft_name, trained
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
    layout: AdapterLayout | None = None
    """LoRA: the adapters the policy carries (an engine with its own weights then takes only them:
    `adapters`); None: the whole model trains."""

    def __call__(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors cast to `dtype` (None: as held), for an engine's `wake`."""
        return iter_full_state_dict(self.hf, dtype=dtype)

    def adapters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the adapters and the trained norms alone, full fp32 tensors under their PEFT names
        (`base_model.model.<module>.lora_A.weight`, `base_model.model.model.norm.weight`), gathered one at a
        time; the frozen base is never gathered."""
        for name, tensor in iter_full_state_dict(self.hf, only=trained(self.hf)):
            yield peft_name(name), tensor

    def merged(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the plain model's tensors, each adapted weight merged (W + alpha/r B A, in float32) before
        the cast to `export_dtype`: the HF export of the adapted policy."""
        return self._cast(merged_stream(iter_full_state_dict(self.hf), self.layout))

    def base(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the frozen base's tensors under the plain model's names (the toy's base, which has no model
        directory for an adapter to name); a trained norm as it was when the adapters were added."""
        held = getattr(self.hf, "adapter_base_norms", {})
        missing = [name for name in self.layout.norms if name not in held]
        if missing:
            raise FlashdapoError(f"the base's values of the trained norms {missing[:3]} were not kept "
                                 "(the adapters were added before the base loaded: model.path is the base)")

        def frozen(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return held[name].to(tensor.dtype) if name in held else tensor
        return self._cast((base_name(name), frozen(name, tensor))
                          for name, tensor in iter_full_state_dict(self.hf, only=lambda n: not is_adapter(n)))

    def _cast(self, named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            cast = self.export_dtype is not None and tensor.is_floating_point()
            yield name, tensor.to(self.export_dtype) if cast else tensor

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
    return WeightSource(hf, torch.bfloat16 if model_dtype == "bfloat16" else None, layout=layout_of(hf))

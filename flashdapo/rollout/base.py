"""What every rollout engine takes and returns."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of responses."""

    n: int = 1
    """Responses per prompt (the group size G)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    max_new_tokens: int = 256
    seed: int = 0
    """Base seed of this call; engines derive per-request seeds from it so that runs repeat."""


@dataclass
class Rollouts:
    """A batch of sampled responses, `n` per prompt, grouped: response i belongs to prompt group_ids[i].

    Ragged sequences are stored as lists of 1-D int64 tensors (no padding): the trainer packs them.
    """

    prompt_ids: list[torch.Tensor]
    """Prompt token ids of each response (the same tensor object for the n responses of a prompt)."""
    response_ids: list[torch.Tensor]
    """Sampled response token ids, including the EOS token when one was sampled."""
    group_ids: torch.Tensor
    """[B] int64: index of the prompt (in the batch passed to generate) each response answers."""
    truncated: torch.Tensor
    """[B] bool: generation hit max_new_tokens without an EOS (vLLM finish reason "length")."""
    logprobs: list[torch.Tensor] | None = None
    """Per-token log-probs of the sampled tokens under the sampler's distribution (fp32), if known."""

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] int64 number of response tokens."""
        return torch.tensor([len(r) for r in self.response_ids], dtype=torch.long)

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return torch.tensor([len(p) for p in self.prompt_ids], dtype=torch.long)


class RolloutEngine(Protocol):
    """Samples responses from the current policy. Engines are stateful (weights, caches, memory)."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        """Sample `sampling.n` responses for each prompt (token ids); group_ids index `prompts`."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (HF parameter names, full tensors), streamed one at a time."""
        ...

    def sleep(self) -> None:
        """Release generation memory while the trainer runs (no-op where meaningless)."""
        ...

    def wake(self) -> None:
        """Re-acquire generation memory before the next `generate` (no-op where meaningless)."""
        ...

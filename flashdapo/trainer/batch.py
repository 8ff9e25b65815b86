"""The step's training batch: whole groups of scored responses, and how they split into mini- and
micro-batches.

A group (one prompt, its n responses) never splits: not across data-parallel ranks, not across
mini-batches. Micro-batches cut a rank's share of a mini-batch by a token budget; every rank runs the
same number of micro-batches (agreed by an all-reduce), because each FSDP2 forward is a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .distributed import all_reduce


@dataclass
class Group:
    """One prompt and its scored responses."""

    prompt: torch.Tensor
    """Prompt token ids."""
    responses: list[torch.Tensor]
    """Response token ids, n of them."""
    scores: torch.Tensor
    """[n] shaped reward: correctness (+1/-1) plus the overlong penalty."""
    acc: torch.Tensor
    """[n] bool: verifier says correct."""
    truncated: torch.Tensor
    """[n] bool: hit the max response length."""
    sampler_logprobs: list[torch.Tensor] | None = None
    """The rollout engine's per-token log-probs, when it reports them."""

    @property
    def size(self) -> int:
        return len(self.responses)


@dataclass
class TrainBatch:
    """This rank's groups of the step, flattened per response, with what the update needs."""

    groups: list[Group]
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """[B] one advantage per response (broadcast to its tokens)."""
    old_logprobs: list[torch.Tensor] | None = None
    """Per response: log-probs of the response tokens under the policy before the update."""
    loss_mask: torch.Tensor | None = None
    """[B] 1 if the response's tokens enter the loss (0: overlong-filtered)."""

    @property
    def prompts(self) -> list[torch.Tensor]:
        return [g.prompt for g in self.groups for _ in g.responses]

    @property
    def responses(self) -> list[torch.Tensor]:
        return [r for g in self.groups for r in g.responses]

    @property
    def group_ids(self) -> torch.Tensor:
        return torch.cat([torch.full((g.size,), i, dtype=torch.long) for i, g in enumerate(self.groups)]) \
            if self.groups else torch.zeros(0, dtype=torch.long)

    @property
    def scores(self) -> torch.Tensor:
        return _cat([g.scores.float() for g in self.groups], torch.float32)

    @property
    def acc(self) -> torch.Tensor:
        return _cat([g.acc for g in self.groups], torch.bool)

    @property
    def truncated(self) -> torch.Tensor:
        return _cat([g.truncated for g in self.groups], torch.bool)

    def responses_lengths_tensor(self) -> torch.Tensor:
        return torch.tensor([len(r) for r in self.responses], dtype=torch.long)

    def prompt_lengths_tensor(self) -> torch.Tensor:
        return torch.tensor([len(g.prompt) for g in self.groups for _ in g.responses], dtype=torch.long)

    def response_slices(self, group_slice: slice) -> slice:
        """Response-index range covered by a contiguous range of groups."""
        sizes = [g.size for g in self.groups]
        start = sum(sizes[: group_slice.start])
        return slice(start, start + sum(sizes[group_slice]))


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def mini_batch_slices(num_groups: int, num_mini_batches: int) -> list[slice]:
    """Split this rank's groups into contiguous mini-batches of whole groups, as equal as possible (they
    are equal unless dynamic sampling came back short and trained on what it found)."""
    count = max(1, min(num_mini_batches, num_groups))
    bounds = [round(i * num_groups / count) for i in range(count + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(count)]


def rank_share(num_groups: int, num_mini_batches: int, world_size: int, rank: int) -> list[int]:
    """Which of the step's globally ordered groups rank `rank` trains on.

    Global mini-batch k is a contiguous run of groups (as it would be on one rank); each rank takes its
    contiguous part of every mini-batch. So rank r's local mini-batch k, cut by `mini_batch_slices`, holds
    exactly its part of global mini-batch k, and N ranks reproduce one rank's optimizer steps.
    `num_groups` must be a multiple of the world size.
    """
    per_rank = num_groups // world_size
    indices, offset = [], 0
    for part in mini_batch_slices(per_rank, num_mini_batches):
        size = part.stop - part.start
        indices += range(offset + rank * size, offset + (rank + 1) * size)
        offset += size * world_size
    return indices


def plan_micro_batches(token_counts: list[int], budget: int, padded: bool = False) -> list[list[int]]:
    """Indices of sequences per micro-batch, the same number of micro-batches on every rank (the most any
    rank needs; each FSDP2 forward is a collective).

    packed (flash-attn varlen) rows cost their real tokens: first-fit decreasing bins of at most `budget`
    tokens, then spread over the agreed count, longest first into the least-loaded bin. Padded rows cost
    rows x longest: sequences sorted by length fill bins while rows x longest <= budget. A sequence longer
    than the budget gets a micro-batch of its own; a rank with less work than others gets empty
    micro-batches (the caller runs a dummy forward there).
    """
    if padded:
        bins = _padded_bins(token_counts, budget)
        count = int(all_reduce(torch.tensor([max(len(bins), 1)]), "max").item())
        return [sorted(b) for b in bins] + [[] for _ in range(count - len(bins))]
    needed = _first_fit_count(token_counts, budget)
    count = int(all_reduce(torch.tensor([needed]), "max").item())
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for idx in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        target = min(range(count), key=lambda b: (loads[b], b))
        bins[target].append(idx)
        loads[target] += token_counts[idx]
    return [sorted(b) for b in bins]


def _padded_bins(token_counts: list[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    for idx in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        # Sorted longest first, so a bin's first sequence sets its padded width.
        if bins and (len(bins[-1]) + 1) * token_counts[bins[-1][0]] <= budget:
            bins[-1].append(idx)
        else:
            bins.append([idx])
    return bins


def _first_fit_count(token_counts: list[int], budget: int) -> int:
    loads: list[int] = []
    for n in sorted(token_counts, reverse=True):
        for i, load in enumerate(loads):
            if load + n <= budget:
                loads[i] += n
                break
        else:
            loads.append(n)
    return max(len(loads), 1)

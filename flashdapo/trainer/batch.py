"""The step's training batch: whole groups of scored responses, and how they split into mini- and
micro-batches.

A group (one prompt, its n responses) never splits across mini-batches. Its responses may be dealt to
different data-parallel slots (`dealing.py` balances the slots' tokens): each slot then holds a piece of the
group, carrying the advantages computed over the whole group and which of its responses it holds.
Micro-batches cut a rank's share of a mini-batch by a token budget; every rank runs the same number of
micro-batches (agreed by an all-reduce), because each FSDP2 forward is a collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..algorithm import group_advantages, loss_normalizers, response_loss_mask, rollout_correction_weights
from ..config import AlgorithmConfig
from ..distributed.collectives import all_gather_objects, all_reduce


@dataclass
class Group:
    """One prompt and its scored responses: all n of them, or the piece of them dealt to one slot."""

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
    origin: tuple[int, int, int] = (0, 0, 0)
    """(generation round, rank, position in the round) where it was sampled: names it across ranks."""
    versions: list[torch.Tensor] | None = None
    """Per response, [len] int64: the policy version that sampled each token (streaming); None: this
    step's."""
    members: tuple[int, ...] | None = None
    """Which responses of the group as generated these are (a piece dealt to a slot); None: all, in order."""
    advantages: torch.Tensor | None = None
    """[size] advantages computed over the whole group when it was dealt (a piece cannot compute its own);
    None: computed from `scores` by build_train_batch (a whole group)."""
    routes: list[torch.Tensor] | None = None
    """Routing replay (algorithm.routing_replay=r3): per response, the experts the engine routed each fed
    position to, [prompt + response - 1, sparse layers, top_k] (models/moe/replay.py); None: not recorded."""

    @property
    def size(self) -> int:
        return len(self.responses)

    @property
    def member_indices(self) -> tuple[int, ...]:
        """Positions of these responses in the group as generated."""
        return tuple(range(self.size)) if self.members is None else self.members

    def to_plain(self) -> dict[str, Any]:
        """The whole group as plain containers (tensors, lists, ints) for torch.save(weights_only): the one
        codec of a group, used by streaming's state, split placement's wire message and its checkpoint
        parts."""
        if self.members is not None:
            raise ValueError(
                f"group {self.origin}: a piece dealt to a slot is never saved or sent, only whole groups")
        return {
            name: (list(self.origin) if name == "origin" else getattr(self, name))
            for name in PLAIN_FIELDS
        }

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> Group:
        """The group `to_plain` wrote (a piece's fields, None in what earlier versions wrote, are ignored)."""
        return cls(**{name: (tuple(plain["origin"]) if name == "origin" else plain[name])
                      for name in PLAIN_FIELDS if name in plain})

    def piece(self, members: Sequence[int], advantages: torch.Tensor) -> Group:
        """The group's responses at `members` (positions in this group), with `advantages` of the whole
        group."""
        idx = list(members)
        return Group(
            prompt=self.prompt, responses=[self.responses[i] for i in idx], scores=self.scores[idx],
            acc=self.acc[idx], truncated=self.truncated[idx], sampler_logprobs=None
            if self.sampler_logprobs is None else [self.sampler_logprobs[i] for i in idx],
            versions=None if self.versions is None else [self.versions[i] for i in idx],
            routes=None if self.routes is None else [self.routes[i] for i in idx], origin=self.origin,
            members=tuple(self.member_indices[i] for i in idx), advantages=advantages[idx])


PLAIN_FIELDS = ("prompt", "responses", "scores", "acc", "truncated", "sampler_logprobs", "origin", "versions",
                "routes")
"""A whole group's fields, as saved and sent (`members` and `advantages` belong to a dealt piece only)."""


def flat_prompts(groups: Sequence[Group]) -> list[torch.Tensor]:
    """The prompt of every response, in order (a group's prompt repeated once per response)."""
    return [g.prompt for g in groups for _ in g.responses]


def flat_responses(groups: Sequence[Group]) -> list[torch.Tensor]:
    """Every response of `groups`, in order."""
    return [r for g in groups for r in g.responses]


def flat_routes(groups: Sequence[Group]) -> list[torch.Tensor | None] | None:
    """Every response's recorded routes (routing replay), in order (None for a group without); None when no
    group has any."""
    if all(g.routes is None for g in groups):
        return None
    return [r for g in groups for r in (g.routes if g.routes is not None else [None] * g.size)]


@dataclass(frozen=True)
class TrainBatch:
    """This rank's groups of the step with every per-response field the update reads.

    Built once, by `build_train_batch`, after the old log-probs are known; never changed afterwards.
    """

    groups: tuple[Group, ...]
    mini_batches: tuple[slice, ...]
    """Contiguous runs of `groups`, one per optimizer step (as dealt by `dealing.deal_to_slots`)."""
    old_logprobs: tuple[torch.Tensor, ...] | None
    """Per response: log-probs of the response tokens under the policy before the update; None when the
    update is on-policy (one mini-batch, one epoch: pi_old is the current policy, detached)."""
    advantages: torch.Tensor
    """[B] one advantage per response (broadcast to its tokens)."""
    loss_mask: torch.Tensor
    """[B] bool: the response's tokens enter the loss (False: overlong-filtered)."""
    rollout_weights: tuple[torch.Tensor, ...]
    """Per response: the rollout correction's detached per-token loss factor (1 without a correction; 0:
    the token leaves the loss and its normalizer)."""

    def __post_init__(self) -> None:
        sizes = [len(r) for r in self.responses]
        if self.old_logprobs is not None and [len(t) for t in self.old_logprobs] != sizes:
            raise ValueError(
                f"old_logprobs must hold one tensor per response of the same length ({len(sizes)} "
                f"responses), got lengths {[len(t) for t in self.old_logprobs]}")
        if [len(t) for t in self.rollout_weights] != sizes:
            raise ValueError(
                f"rollout_weights must hold one tensor per response of the same length ({len(sizes)} "
                f"responses), got lengths {[len(t) for t in self.rollout_weights]}")
        for name in ("advantages", "loss_mask"):
            if tuple(getattr(self, name).shape) != (len(sizes),):
                raise ValueError(f"{name} must be [{len(sizes)}] (one per response), got "
                                 f"{tuple(getattr(self, name).shape)}")

    @property
    def prompts(self) -> list[torch.Tensor]:
        return flat_prompts(self.groups)

    @property
    def responses(self) -> list[torch.Tensor]:
        return flat_responses(self.groups)

    @property
    def routes(self) -> list[torch.Tensor | None] | None:
        """Per response, its recorded routes (routing replay); None when no group has any."""
        return flat_routes(self.groups)

    @property
    def scores(self) -> torch.Tensor:
        return _cat([g.scores.float() for g in self.groups], torch.float32)

    @property
    def truncated(self) -> torch.Tensor:
        return _cat([g.truncated for g in self.groups], torch.bool)

    @property
    def acc(self) -> torch.Tensor:
        """[B] bool: the verifier judged the response correct."""
        return _cat([g.acc.bool() for g in self.groups], torch.bool)

    @property
    def response_keys(self) -> list[tuple[tuple[int, int, int], int]]:
        """Per response, (its group's origin, its position in the group): sorted, the order one rank would
        hold the step's responses in (what order-dependent loss normalizers read)."""
        return [(g.origin, m) for g in self.groups for m in g.member_indices]

    def responses_lengths_tensor(self) -> torch.Tensor:
        return torch.tensor([len(r) for r in self.responses], dtype=torch.long)

    def prompt_lengths_tensor(self) -> torch.Tensor:
        return torch.tensor([len(p) for p in self.prompts], dtype=torch.long)

    def response_slices(self, group_slice: slice) -> slice:
        """Response-index range covered by a contiguous range of groups."""
        sizes = [g.size for g in self.groups]
        start = sum(sizes[: group_slice.start])
        return slice(start, start + sum(sizes[group_slice]))


def build_train_batch(mini_batches: Sequence[Sequence[Group]], old_logprobs: Sequence[torch.Tensor] | None,
                      algo: AlgorithmConfig, correction: str = "none") -> TrainBatch:
    """The step's TrainBatch from this rank's groups per mini-batch and their old log-probs (in the same
    order): advantages, the loss mask and the weights of the rollout correction `correction` (a mode of
    `algorithm.rollout_correction`, resolved) computed here, by `flashdapo.algorithm`, once."""
    groups = tuple(g for part in mini_batches for g in part)
    bounds = list(itertools.accumulate((len(part) for part in mini_batches), initial=0))
    truncated = _cat([g.truncated for g in groups], torch.bool)
    return TrainBatch(
        groups=groups,
        mini_batches=tuple(slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])),
        old_logprobs=None if old_logprobs is None else tuple(old_logprobs),
        advantages=_cat([
            g.advantages if g.advantages is not None else whole_group_advantages(g, algo.advantage_eps)
            for g in groups
        ], torch.float32),
        loss_mask=response_loss_mask(truncated, algo),
        rollout_weights=_rollout_weights(groups, old_logprobs, correction, algo.rollout_correction_cap),
    )


def whole_group_advantages(group: Group, eps: float) -> torch.Tensor:
    """[n] advantages of a whole group from its scores (`algorithm.group_advantages`)."""
    if group.members is not None and group.advantages is None:
        raise ValueError(f"group {group.origin}: a piece of a group needs the whole group's advantages")
    return group_advantages(group.scores.float(), torch.zeros(group.size, dtype=torch.long), eps)


def _rollout_weights(groups: Sequence[Group], old_logprobs: Sequence[torch.Tensor] | None, mode: str,
                     cap: float) -> tuple[torch.Tensor, ...]:
    lengths = torch.tensor([len(r) for r in flat_responses(groups)], dtype=torch.long)
    if mode == "none":
        return tuple(torch.ones(int(n)) for n in lengths)
    if old_logprobs is None:  # `on_policy` recomputes pi_old whenever a correction is on
        raise ValueError(f"algorithm.rollout_correction={mode} needs pi_old's log-probs before the update")
    sampled = [lp for g in groups for lp in (g.sampler_logprobs or [])]
    if len(sampled) != len(lengths):
        raise ValueError(
            f"algorithm.rollout_correction={mode} needs the rollout engine's per-token log-probs, "
            f"and {len(lengths) - len(sampled)} of {len(lengths)} responses came without")
    old = torch.cat(list(old_logprobs)) if old_logprobs else torch.zeros(0)
    rollout = torch.cat(sampled) if sampled else torch.zeros(0)
    weights = rollout_correction_weights(old, rollout, lengths, mode, cap)
    return tuple(torch.split(weights, lengths.tolist()))


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def plan_micro_batches(token_counts: list[int], budget: int, padded: bool = False) -> list[list[int]]:
    """Indices of sequences per micro-batch, the same number of micro-batches on every rank (the most any
    rank needs; each FSDP2 forward is a collective).

    packed rows cost their real tokens: first-fit decreasing bins of at most `budget`
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


def mini_batch_normalizers(valid_tokens: torch.Tensor, algo: AlgorithmConfig, sequence_parallel: int = 1,
                           keys: Sequence[Any] | None = None) -> tuple[torch.Tensor, int]:
    """This rank's part of a mini-batch -> (the loss normalizer of each of its responses, global valid
    tokens).

    `valid_tokens` [b] counts the valid tokens of this rank's responses of the mini-batch; `keys` [b] name
    them, sorting into the order one rank would hold the whole mini-batch in (default: this rank's part
    follows the previous ranks' parts). The gathered counts, in that order, are the whole mini-batch, and
    `loss_normalizers` of them under `algo.loss_agg_mode` does not depend on the number of ranks, on which
    rank holds which response, or on the micro-batches. One all-gather of b (key, count) pairs per
    mini-batch; without an initialized process group, the local counts. With sequence parallelism the
    `sequence_parallel` consecutive ranks of a group hold the same responses: the first of each speaks for it.
    """
    slot = dist.get_rank() // sequence_parallel if dist.is_initialized() else 0
    local = [int(n) for n in valid_tokens.tolist()]
    named = list(zip(keys if keys is not None else ((slot, i) for i in range(len(local))), local))
    everyone = sorted((pair for part in all_gather_objects(named)[::sequence_parallel] for pair in part),
                      key=lambda pair: pair[0])
    position = {key: i for i, (key, _) in enumerate(everyone)}
    if len(position) != len(everyone):
        raise ValueError("mini_batch_normalizers: two responses of the mini-batch have the same key")
    counts = torch.tensor([n for _, n in everyone], dtype=torch.long)
    normalizers = loss_normalizers(counts, algo.loss_agg_mode, algo.loss_agg_micro_batch)
    mine = torch.tensor([position[key] for key, _ in named], dtype=torch.long)
    return normalizers[mine], int(counts.sum())

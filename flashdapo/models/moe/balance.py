"""The routers' load-balancing loss of one micro-batch, per sequence, and the load on each expert.

The loss is the Switch-Transformer one that transformers' `load_balancing_loss_func` computes (Qwen3-MoE and
the other softmax top-k routers): over a set of tokens and the L sparse layers,

    aux = E * sum_i f_i * P_i,   f_i = (top-k picks of expert i) / (L * tokens),
                                 P_i = (sum of expert i's softmax probability) / (L * tokens),

f being a count (no gradient) and P differentiable. transformers takes the set to be its forward's batch
(padding masked out). That product is not a sum over tokens: the loss of a batch is not the sum of its
micro-batches' losses, so a batch-level loss would change with the micro-batch split and the number of
ranks. flashdapo takes the set to be ONE SEQUENCE (its prompt and response tokens as fed; padding and the
sequence-parallel filler left out): a sequence is never split by micro-batching or data parallelism, so
the update's term, the mean over the mini-batch's sequences (trainer/update.py), is the same on any
number of ranks and micro-batches. For a micro-batch of one sequence it is exactly transformers' value.
Under sequence parallelism a sequence spans the group's shards: the counts (no gradient) are summed over
the group, and each rank's share is E * sum_i f_i * (its own probability sums) / (L * tokens); the
shares add up to the loss and its gradient.

Under routing replay (replay.py) f counts the experts the tokens were dispatched to, the engine's records,
not the router's own top-k: the load balanced is the load carried. P is the router's, as always.

Probabilities are taken in fp32 (or the logits' wider dtype), whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...distributed.collectives import all_reduce
from ..packing import DocumentBounds
from ..ulysses import shard_bounds


@dataclass
class Balance:
    """A micro-batch's load-balancing loss and expert load on this rank."""

    loss_sum: torch.Tensor
    """Sum over the micro-batch's sequences of their load-balancing losses (this rank's share of each under
    sequence parallelism): scalar, differentiable in the router weights."""
    load: torch.Tensor
    """[L, E] top-k picks of each expert per sparse layer, over this rank's real tokens (no gradient)."""


def token_sequences(num_sequences: int, bounds: DocumentBounds | None, attention_mask: torch.Tensor | None,
                    sp: int = 1, sp_rank: int = 0) -> torch.Tensor:
    """[tokens] which of the `num_sequences` sequences each token of this rank's forward belongs to, in the
    router logits' row order; -1 for padding (padded layout: `attention_mask` [B, L]) and for the filler a
    packed row gets under sequence parallelism (packed: the row's `bounds`; this is rank `sp_rank`'s shard),
    and for every row past the first `num_sequences` (0: a placeholder micro-batch, nothing counts)."""
    if bounds is None:
        rows = torch.arange(attention_mask.shape[0],
                            device=attention_mask.device)[:, None].expand_as(attention_mask)
        return torch.where(attention_mask.bool() & (rows < num_sequences), rows, -1).reshape(-1)
    lengths = torch.diff(torch.tensor(bounds.offsets))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    ids = torch.where(ids < num_sequences, ids, -1)
    if sp > 1:
        start, end = shard_bounds(len(ids), sp, sp_rank)
        ids = ids[start:end]
    return ids.to(bounds.cu_seqlens.device)


def load_balancing(router_logits: tuple[torch.Tensor, ...], sequence: torch.Tensor, num_sequences: int,
                   top_k: int, sp_group: dist.ProcessGroup | None = None,
                   chosen: tuple[torch.Tensor, ...] | None = None) -> Balance:
    """Per-sequence load-balancing losses (summed) and per-layer expert load of one forward.

    `router_logits`: one [tokens, E] tensor per sparse layer, as transformers records them with
    `output_router_logits=True`; `sequence` [tokens]: `token_sequences`; `sp_group`: the sequence-parallel
    group whose ranks hold the other shards of these sequences (None: none); `chosen`: one [tokens, k] tensor
    per layer, the experts the tokens were dispatched to when they are not the router's own top-k (routing
    replay: the engine's), counted in f and the load in its place (as Megatron's router replay counts its
    replayed routing map); None: the top-k of the logits.
    """
    keep = sequence >= 0
    seq = sequence[keep]
    first = router_logits[0]
    num_experts = first.shape[-1]
    dtype = torch.promote_types(first.dtype, torch.float32)
    picks = torch.zeros(num_sequences, num_experts, dtype=dtype, device=first.device)
    probs = torch.zeros(num_sequences, num_experts, dtype=dtype, device=first.device)
    load = torch.zeros(len(router_logits), num_experts, dtype=torch.float64, device=first.device)
    for layer, logits in enumerate(router_logits):
        p = torch.softmax(logits[keep].to(dtype), dim=-1)
        picked = torch.topk(p, top_k, dim=-1).indices if chosen is None else chosen[layer][keep].long()
        with torch.no_grad():
            picks.index_put_((seq[:, None].expand_as(picked), picked),
                             torch.ones((), dtype=dtype, device=p.device), accumulate=True)
            load[layer] = torch.bincount(picked.reshape(-1), minlength=num_experts).to(load.dtype)
        probs = probs.index_add(0, seq, p)
    rows = torch.bincount(seq, minlength=num_sequences).to(dtype) * len(router_logits)
    if sp_group is not None and dist.get_world_size(sp_group) > 1:  # the sequences' other shards' counts
        summed = all_reduce(torch.cat([picks, rows[:, None]], dim=1), group=sp_group)
        picks, rows = summed[:, :-1], summed[:, -1]
    rows = rows.clamp(min=1)  # a sequence always has tokens; the clamp keeps 0/0 out of a malformed input
    per_sequence = num_experts * (picks / rows[:, None] * probs / rows[:, None]).sum(dim=1)
    return Balance(per_sequence.sum(), load)


__all__ = ["Balance", "load_balancing", "token_sequences"]

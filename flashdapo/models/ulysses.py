"""Ulysses sequence parallelism (DeepSpeed-Ulysses; verl ships it for HF models): the sp ranks of a group
share one packed micro-batch, each holding 1/sp of its tokens.

Everything outside attention is per token, so each rank runs the embeddings, MLPs, norms, the LM head,
the log-probs and the DAPO loss on its own shard only: no rank ever holds the logits or hidden states of
the whole row. Attention needs the whole row, so around it one all-to-all turns the sequence shards of
q, k and v ([1, H, T/sp, D] on each rank) into head shards of the whole row ([1, H/sp, T, D]), attention
runs per document on them (`packing.py`), and a second all-to-all turns the output back. Query heads must
divide by sp; key/value heads must divide by sp (head chunk i of the queries then uses KV chunk i) or
divide sp: with fewer KV heads than ranks each is repeated sp / Hkv times before the all-to-all, as verl
and DeepSpeed do, so that the rank holding a chunk of query heads receives the one KV head their
grouped-query group reads (the repeat's backward sums the copies' gradients: exact). Per-head parameters
read inside attention (GPT-OSS's sinks) are sliced to the rank's head chunk (`local_heads`). Rotary
position ids are sliced with the tokens, so each token keeps the position it has in its own response;
the packing boundaries (`DocumentBounds`) describe the whole row and are the same on every rank of a group.

Gradients: the all-to-all's backward is the reverse all-to-all. Each rank's loss covers its own tokens,
divided by the mini-batch's global normalizer, and FSDP2 sums gradients over every rank, so the sum over
the group is the gradient one rank would compute on the whole row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from ..distributed.mesh import SequenceParallelError
from .hf import layer_configs


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[1, H, S, D] (all heads, this rank's sequence shard) -> [1, H/sp, sp*S, D] (this rank's heads, whole
    row)."""
    sp = dist.get_world_size(group)
    _, heads, length, dim = x.shape
    chunks = x.reshape(sp, heads // sp, length, dim).contiguous()  # chunk j of the heads goes to rank j
    received = _all_to_all(chunks, group)  # [sp (source rank: sequence shard), H/sp, S, D]
    return received.transpose(0, 1).reshape(1, heads // sp, sp * length, dim)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[1, sp*S, H/sp, D] (whole row, this rank's heads) -> [1, S, H, D] (this rank's sequence shard, all
    heads)."""
    sp = dist.get_world_size(group)
    _, length, heads, dim = x.shape
    chunks = x.reshape(sp, length // sp, heads, dim).contiguous()  # chunk j of the sequence goes to rank j
    received = _all_to_all(chunks, group)  # [sp (source rank: head chunk), S, H/sp, D]
    return received.transpose(0, 1).reshape(1, length // sp, sp * heads, dim)


def expand_kv_heads(x: torch.Tensor, sp: int) -> torch.Tensor:
    """[1, Hkv, S, D] -> [1, sp, S, D] when Hkv < sp (Hkv dividing sp): each KV head repeated sp / Hkv times,
    copies adjacent, so chunk i of the result is the KV head that query head chunk i uses (grouped-query
    attention: query head h reads KV head h // (H / Hkv)); `x` itself when Hkv >= sp."""
    heads = x.shape[1]
    return x if heads >= sp else x.repeat_interleave(sp // heads, dim=1)


def local_heads(per_head: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's entries of a per-query-head tensor [H, ...] (GPT-OSS's attention sinks): chunk `rank` of
    sp, the heads `sequence_to_heads` gives this rank. Its gradient reaches only those heads; the other ranks'
    cover the rest, and the gradient reduction over ranks sums them."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    return per_head.reshape(sp, per_head.shape[0] // sp, *per_head.shape[1:])[rank]


def _all_to_all(chunks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk j of dim 0 to rank j, chunk i of the result from rank i; its backward is the reverse exchange."""
    return wait_tensor(all_to_all_single_autograd(chunks, None, None, group))


def heads_fit(num_heads: int, num_kv_heads: int, sp: int) -> bool:
    """Whether the all-to-all can split the heads into sp chunks: sp divides the query heads, and the KV
    heads divide by sp or divide sp (then they are repeated, `expand_kv_heads`)."""
    return num_heads % sp == 0 and (num_kv_heads % sp == 0 or sp % num_kv_heads == 0)


def check_heads(num_heads: int, num_kv_heads: int, sp: int) -> None:
    """One-line error unless the heads split into sp chunks (`heads_fit`), naming the sizes that do."""
    check_layer_heads([(num_heads, num_kv_heads)], sp)


def layer_heads(config) -> list[tuple[int, int]]:
    """(query heads, key/value heads) of each kind of attention layer of an HF config (`hf.layer_configs`:
    Gemma 4's full-attention layers carry key/value heads of their own)."""
    return sorted({(c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
                   for c in layer_configs(config)})


def check_layer_heads(kinds: list[tuple[int, int]], sp: int) -> None:
    """`check_heads` for every kind of attention layer (`layer_heads`): one line naming the kind that does not
    split into sp chunks and the sizes that fit every kind."""
    bad = [(heads, kv) for heads, kv in kinds if not heads_fit(heads, kv, sp)]
    if not bad:
        return
    fitting = ", ".join(str(s) for s in range(1, max(h for h, _ in kinds) + 1)
                        if all(heads_fit(h, kv, s) for h, kv in kinds))
    which = "" if len(kinds) == 1 else f" ({len(kinds)} kinds of attention layer: " + ", ".join(
        f"{h}/{kv}" for h, kv in kinds) + " query/key-value heads)"
    raise SequenceParallelError(
        f"trainer.sequence_parallel={sp} does not fit the model's {bad[0][0]} query heads and {bad[0][1]} "
        f"key/value heads{which} (query heads must divide by it; key/value heads must divide by it or divide "
        "it): "
        f"choose one of {fitting}")


def shard_bounds(length: int, sp: int, sp_rank: int) -> tuple[int, int]:
    """[start, end) of rank `sp_rank`'s shard of a row of `length` tokens (a multiple of sp)."""
    size = length // sp
    return sp_rank * size, (sp_rank + 1) * size


def local_predictions(predict_index: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of a row's prediction positions, those in [start, end): (their indices into `predict_index`, i.e.
    which of the micro-batch's response tokens this rank holds, and their positions in the shard)."""
    held = torch.nonzero((predict_index >= start) & (predict_index < end)).squeeze(1)
    return held, predict_index[held] - start


def gather_token_values(values: torch.Tensor, held: torch.Tensor, total: int,
                        group: dist.ProcessGroup) -> torch.Tensor:
    """A per-token vector of the whole micro-batch [total] from each rank's values at its `held` tokens (for
    the old log-probs: [total] floats, never hidden states or logits). Shards are disjoint: a sum."""
    full = values.new_zeros(total).index_put((held,), values)
    dist.all_reduce(full, group=group)
    return full


__all__ = [
    "check_heads", "check_layer_heads", "expand_kv_heads", "gather_token_values", "heads_fit",
    "heads_to_sequence", "layer_heads", "local_heads", "local_predictions", "sequence_to_heads",
    "shard_bounds"
]

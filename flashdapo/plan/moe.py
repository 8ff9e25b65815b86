"""What the plan knows of a mixture-of-experts model: its routed experts (found on the meta-built model, the
way expert parallelism finds them: models/moe/expert_parallel.py `expert_modules`), top-k, widths, and how
expert parallelism shards the experts' tensors.

Expert parallelism (trainer.expert_parallel = E, models/moe/expert_parallel.py): rank r holds experts
[(r % E) n / E, (r % E + 1) n / E) of every MoE layer (n = num_experts); FSDP2 shards those over the
world / E ranks holding the same experts (the same r % E), on dim 0 when each of them gets at least one
whole expert (world <= n), else on dim 1 (torchtitan's rule, as the trainer applies it). So an expert
tensor's sharded state is ~1/world of it, like every other tensor's, but its all-gather over those ranks
yields only 1/E of the layer's experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..models.moe.expert_parallel import expert_modules


@dataclass(frozen=True)
class MoeShape:
    """The routed experts of an MoE model (read from its config and its meta-built modules)."""

    num_experts: int
    top_k: int
    moe_intermediate: int
    """One routed expert's MLP width."""
    shared_intermediate: int
    """The always-active shared expert(s)' total MLP width per MoE layer (0: none)."""
    moe_layers: int
    """Decoder blocks with routed experts (the others are dense: mlp_only_layers, decoder_sparse_step)."""

    @property
    def routed_width(self) -> int:
        """MLP width one token activates in an MoE layer: its top-k experts and the shared ones."""
        return self.top_k * self.moe_intermediate + self.shared_intermediate


def moe_shape(model: nn.Module) -> tuple[MoeShape | None, frozenset[str]]:
    """The model's MoE description and the names of its routed-expert parameters (None and no names for a
    dense model). Shared experts are ordinary block parameters: always active, not expert tensors here."""
    modules = expert_modules(model)
    if not modules:
        return None, frozenset()
    ids = {id(m) for m in modules}
    names = frozenset(f"{prefix}.{pname}" for prefix, module in model.named_modules() if id(module) in ids
                      for pname, _ in module.named_parameters())
    c = model.config
    top_k = _first(c, "num_experts_per_tok", "experts_per_token", "moe_topk")
    if top_k is None:
        raise ValueError(f"{c.model_type} config: no num_experts_per_tok (the router's top-k)")
    moe_width = _first(c, "moe_intermediate_size") or c.intermediate_size
    shared = _first(c, "shared_expert_intermediate_size") or \
        (_first(c, "n_shared_experts", "num_shared_experts") or 0) * moe_width
    return MoeShape(num_experts=modules[0].num_experts, top_k=int(top_k), moe_intermediate=int(moe_width),
                    shared_intermediate=int(shared), moe_layers=len(modules)), names


def _first(config: Any, *keys: str) -> Any:
    """The first of `keys` the config sets (not None)."""
    return next((getattr(config, k) for k in keys if getattr(config, k, None) is not None), None)


def expert_shard_numel(shape: tuple[int, ...], world: int, rank: int, expert_parallel: int) -> int:
    """Elements of rank `rank`'s FSDP2 shard of an expert tensor [num_experts, ...] under expert parallelism
    E > 1: its num_experts / E local experts, chunked over the world / E ranks holding them, on dim 0 when
    world <= num_experts, else on dim 1 (torch.chunk: ceil rows per rank, the last fewer or none)."""
    replicas, index = world // expert_parallel, rank // expert_parallel
    local = (shape[0] // expert_parallel,) + tuple(shape[1:])
    dim = 1 if world > shape[0] and len(shape) > 1 else 0
    rows = -(-local[dim] // replicas)
    mine = max(0, min(rows, local[dim] - index * rows))
    return mine * math.prod(local) // local[dim]


def expert_gathered_numel(shape: tuple[int, ...], world: int, expert_parallel: int) -> int:
    """Elements of an expert tensor one rank holds all-gathered under expert parallelism E > 1: its local
    experts (1/E of the layer's), padded shards x the world / E ranks that gather them."""
    replicas = world // expert_parallel
    local = (shape[0] // expert_parallel,) + tuple(shape[1:])
    dim = 1 if world > shape[0] and len(shape) > 1 else 0
    return -(-local[dim] // replicas) * replicas * math.prod(local) // local[dim]


__all__ = ["MoeShape", "expert_gathered_numel", "expert_shard_numel", "moe_shape"]

"""Expert parallelism (`trainer.expert_parallel` = E): each MoE layer's experts spread over E ranks, tokens
sent to the rank holding their expert and back with all-to-all.

The choices, before the code:

- **Which modules.** transformers 5's fused experts (Qwen3-MoE's `Qwen3MoeExperts` and its kin): one module
  per MoE layer holding `gate_up_proj` [num_experts, 2I, H] and `down_proj` [num_experts, H, I], called as
  `experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`. The router (`gate`) and the rest of the
  block run as before, on every rank, on that rank's own tokens.
- **Groups.** `distributed.mesh.expert_parallel_mesh`: a 2-D mesh ("efsdp", "ep"); an "ep" group is E
  consecutive ranks, rank i of it holds experts [i * n, (i + 1) * n), n = num_experts / E. Those parameters
  become DTensors `Shard(0)` on "ep" of the whole [num_experts, ...] tensor, so state dicts, checkpoints
  (DCP) and `DTensor.full_tensor()` (the HF export, the vLLM push: models/weights.py) see whole expert
  tensors, at any E and world size.
- **FSDP2.** The experts module is its own FSDP2 unit on "efsdp" (the ranks holding the same experts),
  registered before its decoder block's, which then leaves those parameters alone: expert weights are
  all-gathered over "efsdp" only, never across "ep". As torchtitan does, the experts' dim 0 is sharded when
  each "efsdp" rank gets at least one expert of the local ones, else their dim 1.
- **Gradients.** The all-to-all's backward is the reverse exchange (`_AllToAll`: an autograd Function around
  `dist.all_to_all_single`, as torchtitan's; torch's functional all_to_all_single_autograd grew memory step on
  step under activation checkpointing there), so rank i's expert gradients sum the contributions of every
  token of its "ep" group routed to them; FSDP2 then sums them over "efsdp". Together: the sum over every
  rank's tokens, as for every other parameter (flashdapo sums, never averages).
- **Collectives in step.** Every rank of an "ep" group must run each MoE layer as often as the others: the
  same rule FSDP2's all-gathers already impose (the update's and the torch engine's padding micro-batches and
  one-token steps). A rank whose experts receive no token still runs them on zero rows, so its expert
  gradients exist (zeros) and its reduce-scatter matches the other ranks'.
- **Gradient norm.** The experts' gradients are DTensors on ("efsdp", "ep"), the others on every rank's mesh;
  torch's clip_grad_norm_ refuses the mix, so `clip_grad_norm_over_meshes` reduces each mesh's norm over
  that mesh and combines them (the update's clipping). AdamW's per-tensor arithmetic needs nothing.
- **Cost.** The local experts run one after another (two matmuls each), not transformers' grouped_mm
  kernel: a known gap on GPUs with many experts per rank.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...distributed.mesh import DistEnv, ExpertParallelError, expert_parallel_mesh

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
"""The fused expert weights of an experts module, [num_experts, ...] each."""


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The fused-experts modules of an HF MoE model, in module order (none in a dense model)."""
    return [m for m in model.modules()
            if hasattr(m, "num_experts") and all(isinstance(getattr(m, n, None), nn.Parameter) and
                                                 getattr(m, n).dim() == 3 for n in EXPERT_PARAMETERS)]


def check_expert_parallel(experts: list[nn.Module], expert_parallel: int) -> None:
    """ExpertParallelError in one line when E > 1 does not fit the model: no MoE layer, or experts that E
    does not divide, or an experts module with weights beyond the two fused ones (biases: not handled)."""
    if expert_parallel == 1:
        return
    if not experts:
        raise ExpertParallelError(f"trainer.expert_parallel={expert_parallel}: the model has no MoE layer "
                                  "(fused experts); use 1 for a dense model")
    for module in experts:
        if module.num_experts % expert_parallel:
            raise ExpertParallelError(f"trainer.expert_parallel={expert_parallel} must divide the model's "
                                      f"num_experts {module.num_experts}")
        if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True) or \
                not getattr(module, "has_gate", True):
            raise ExpertParallelError(
                f"trainer.expert_parallel={expert_parallel}: {type(module).__name__} stores "
                "its experts transposed, interleaved or without a gate, which expert "
                "parallelism does not handle (gate_up_proj [E, 2I, H] then down_proj "
                "[E, H, I]); use 1")
        extra = sorted(n for n, _ in module.named_parameters() if n not in EXPERT_PARAMETERS)
        if extra:
            raise ExpertParallelError(
                f"trainer.expert_parallel={expert_parallel}: {type(module).__name__} has "
                f"parameters beyond {'/'.join(EXPERT_PARAMETERS)} ({', '.join(extra)}), "
                "which expert parallelism does not shard; use 1")


def parallelize_experts(model: nn.Module, env: DistEnv, expert_parallel: int, **fsdp_options) -> None:
    """Expert parallelism over `env`'s ranks (E = `expert_parallel`): each experts module of `model` keeps its
    ranks' experts and becomes an FSDP2 unit over the ranks holding the same ones (`fsdp_options`: those of
    `fully_shard`). Call before the decoder blocks' `fully_shard`. E = 1: checks only (a dense model is fine).
    Split placement's rollout side trains nothing: its experts stay whole (E = 1), as its sequence
    parallelism."""
    if env.role == "rollout":
        expert_parallel = 1
    experts = expert_modules(model)
    check_expert_parallel(experts, expert_parallel)
    if expert_parallel == 1:
        return
    mesh = expert_parallel_mesh(env, expert_parallel)
    replicas = mesh["efsdp"].size()
    for module in experts:
        shard_experts(module, mesh["ep"])
        # torchtitan's rule: dim 0 holds num_experts / E experts; fewer than the "efsdp" ranks would leave
        # some ranks empty shards (padding), so the experts' dim 1 is sharded then.
        split_rows = replicas * expert_parallel > module.num_experts
        fully_shard(module, mesh=mesh["efsdp"],
                    shard_placement_fn=(lambda _p: Shard(1)) if split_rows else None, **fsdp_options)


def shard_experts(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's num_experts / E experts of `module` (DTensors Shard(0) over `ep_mesh`, global shape
    unchanged) and route its forward through the all-to-all. Every rank must hold the same full weights
    (as before FSDP2's own sharding); meta tensors stay meta (loading fills them later)."""
    ep, index = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in EXPERT_PARAMETERS:
        full = getattr(module, name)
        per_rank = full.shape[0] // ep
        local = full.detach()[index * per_rank:(index + 1) * per_rank].clone()
        sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape,
                                     stride=full.stride())
        setattr(module, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
    module.ep_group = ep_mesh.get_group()
    module.forward = types.MethodType(expert_parallel_forward, module)


def expert_parallel_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The fused experts' forward with the experts spread over `module.ep_group`: the same sum over each
    token's top-k experts of weight x expert(token) as the HF module's, each (token, slot) pair computed on
    the rank holding its expert. An index equal to num_experts (HF's "no expert") adds nothing, as in HF."""
    group, experts = module.ep_group, module.num_experts
    ep = dist.get_world_size(group)
    per_rank = experts // ep
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    counts = torch.bincount(flat, minlength=experts + 1)[:experts]  # pairs per expert, from this rank
    order = torch.argsort(flat, stable=True)  # grouped by expert, so by the rank that holds it
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # [source rank, local expert]
    send_splits = counts.view(ep, per_rank).sum(1).tolist()
    recv_splits = received_counts.view(ep, per_rank).sum(1).tolist()
    sent = sum(send_splits)  # HF's "no expert" entries sort last and are not sent
    # Each (token, slot) pair's row: the token's hidden state repeated k times (its gradient: a sum over k),
    # then permuted by expert (a permutation: no two rows add into one).
    width = hidden_states.shape[-1]
    pairs = hidden_states[:, None, :].expand(tokens, top_k, width).reshape(tokens * top_k, width)
    received = _exchange(pairs.index_select(0, order[:sent]), recv_splits, send_splits, group)
    local_expert = torch.repeat_interleave(torch.arange(per_rank, device=counts.device).repeat(ep),
                                           received_counts)
    computed = local_experts(module, received, local_expert, per_rank)
    returned = _exchange(computed, send_splits, recv_splits, group)
    return combine(returned, top_k_weights, order, sent).to(hidden_states.dtype)


def combine(returned: torch.Tensor, top_k_weights: torch.Tensor, order: torch.Tensor,
            sent: int) -> torch.Tensor:
    """[tokens, H] the sum over each token's k slots of weight x expert output, without atomics: `returned`
    holds the first `sent` pairs of `order` (the flattened [tokens * k] pairs sorted by expert), the rest
    (HF's "no expert") add nothing. The rows go back to pair order through the inverse permutation (a gather)
    into a [tokens, k, H] buffer, summed over k in a fixed order: the same bits run to run, on GPUs too (an
    index_add over the tokens is atomic there). Its backward: a gather and a permutation, no accumulation."""
    tokens, top_k = top_k_weights.shape
    weights = top_k_weights.reshape(-1).index_select(0, order[:sent])
    weighted = returned * weights[:, None].to(returned.dtype)
    padded = torch.cat([weighted, weighted.new_zeros(tokens * top_k - sent, weighted.shape[-1])])
    inverse = torch.argsort(order)  # pair p's row in `padded`
    return padded.index_select(0, inverse).view(tokens, top_k, weighted.shape[-1]).sum(dim=1)


def local_experts(module: nn.Module, rows: torch.Tensor, expert: torch.Tensor, count: int) -> torch.Tensor:
    """expert[i](rows[i]) for each row (`expert`: indices into this rank's `count` experts), as HF's experts
    compute it: act(gate) * up, then down. Every local expert runs, on zero rows when it got none: its
    weights then get a zero gradient, never none (see the module docstring)."""
    gate_up, down = (_local(getattr(module, name)) for name in EXPERT_PARAMETERS)
    order = torch.argsort(expert, stable=True)
    sizes = torch.bincount(expert, minlength=count).tolist()
    outputs = []
    for j, part in enumerate(torch.split(rows.index_select(0, order), sizes)):
        outputs.append(nn.functional.linear(_gate(module, nn.functional.linear(part, gate_up[j])), down[j]))
    by_expert = torch.cat(outputs)
    return by_expert.index_select(0, torch.argsort(order))  # back to the rows' order (a permutation)


@torch.no_grad()
def clip_grad_norm_over_meshes(params: list[nn.Parameter], max_norm: float) -> float:
    """The global 2-norm of `params`' gradients, clipped to `max_norm` when it is > 0 (as
    torch.nn.utils.clip_grad_norm_), for gradients that are DTensors on different meshes: under expert
    parallelism the experts' live on ("efsdp", "ep"), the rest on every rank's mesh, and torch's own function
    stacks their norms as one DTensor (it refuses mixed meshes). Each mesh's norm is reduced over that mesh
    (every rank walks the same groups in the same order: collectives), then the norms are combined."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for mesh, members in groups.items():
        if mesh is not None and mesh.ndim > 1:
            norms.append(_sharded_norm([p.grad for p in members], mesh))
            continue
        norm = torch.nn.utils.get_total_norm([p.grad for p in members], norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])) if norms else \
        torch.tensor(0.0)
    if max_norm > 0:
        for members in groups.values():
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, total)
    return float(total)


def _sharded_norm(grads: list[DTensor], mesh: DeviceMesh) -> torch.Tensor:
    """The global 2-norm of DTensor gradients on a multi-dimensional mesh: each placement pattern's sum of
    local squares, summed over the mesh dimensions it is sharded on (a replicated dimension holds copies: not
    summed). torch's get_total_norm stacks per-tensor norms as partial DTensors and reduces them over both
    dimensions at once, with a warning on every rank that it cannot merge the two all-reduces."""
    squares: dict[tuple, torch.Tensor] = {}
    dtype = torch.promote_types(grads[0].dtype, torch.float32)  # fp32 at least; float64 stays float64
    for grad in grads:
        term = torch.linalg.vector_norm(grad.to_local(), 2.0, dtype=dtype) ** 2  # 0 for an empty shard
        key = tuple(grad.placements)
        squares[key] = squares[key] + term if key in squares else term
    total = torch.zeros((), dtype=dtype, device=next(iter(squares.values())).device)
    for placements, square in squares.items():  # the same order on every rank: parameters' order
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                raise ValueError(
                    f"a gradient placed {placements} on the expert mesh: reduced gradients expected")
            if not placement.is_replicate():  # Shard, or FSDP2's _StridedShard over an already-sharded dim
                dist.all_reduce(square, group=mesh.get_group(dim))
        total = total + square
    return total.sqrt()


def full_tensor_by_dim(value: DTensor) -> torch.Tensor:
    """`value.full_tensor()`, on a multi-dimensional mesh one dimension at a time, outermost first (the
    experts' ("efsdp", "ep") weights, their gradient norms): the collectives DTensor would run, without its
    warning that it cannot merge them into one."""
    if value.device_mesh.ndim == 1:
        return value.full_tensor()
    placements = list(value.placements)
    for dim in range(len(placements)):
        placements[dim] = Replicate()
        value = value.redistribute(value.device_mesh, placements)
    return value.to_local()


def _gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of one expert's [rows, 2I] projection, by the module's own gating where it has one
    (transformers' experts integration gives each family's)."""
    if hasattr(module, "_apply_gate"):
        return module._apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a (gathered) expert weight."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    """Rows in_splits[j] to rank j, out_splits[i] from rank i; the backward sends the gradients back."""
    return all_to_all_rows(rows, out_splits, in_splits, group)


def all_to_all_rows(rows: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """The experts' all-to-all (`_AllToAll`), differentiable: looked up here by name at each call, so that a
    wrapper installed in this module sees every exchange (bench/bench_moe.py counts the bytes)."""
    return _AllToAll.apply(rows, output_split_sizes, input_split_sizes, group)


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` with the given splits; its backward the all-to-all of the gradient with the
    splits swapped. Not torch's functional `all_to_all_single_autograd`: under activation checkpointing its
    memory grew step on step in torchtitan (pytorch/torchtitan#1467), which replaced it with this Function."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
        return _all_to_all(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


__all__ = [
    "EXPERT_PARAMETERS", "all_to_all_rows", "check_expert_parallel", "clip_grad_norm_over_meshes", "combine",
    "expert_modules", "expert_parallel_forward", "full_tensor_by_dim", "local_experts", "parallelize_experts",
    "shard_experts"
]

"""The trainer's memory per rank: FSDP2 shards (exact, from the meta model's tensors) and the transients of
one micro-batch (modelled), the way flashdapo/trainer/policy.py `parallelize` and update.py run them.

State (exact). FSDP2 shards every parameter on dim 0 over all ranks (torch.chunk: ceil(d0 / world) rows per
rank). Master weights are fp32 (MixedPrecisionPolicy computes in model.dtype and reduces gradients in fp32),
so per local element: 4 bytes of parameter, 4 of gradient, 8 of AdamW moments (exp_avg, exp_avg_sq), plus a
4-byte `step` scalar per tensor. With trainer.fsdp_cpu_offload all of it lives in host memory. Under expert
parallelism (trainer.expert_parallel = E) a routed expert's tensor is split over E ranks by experts, then by
FSDP2 over the world / E ranks holding the same experts (plan/moe.py): still ~1/world of it per rank.

Transients (modelled), b = bytes of the compute dtype, T = tokens of this rank's largest micro-batch:
- gathered parameters: the root unit (embeddings, final norm, LM head: never resharded between forward and
  backward) plus two decoder blocks (the one running and the one prefetched; every block with
  trainer.reshard_after_forward=false), the largest block; under expert parallelism a block's experts unit
  gathers only its ranks' 1/E of the layer's experts;
- activations: with checkpointing each block keeps its input [T, H] and one block is recomputed in backward
  (`block_saved`: ~(8 H + 3 K + 4 I) T b, K = key/value width, plus its backward's working gradients
  (2 H + 2 I) T b; in an MoE layer I is top_k x the expert width plus the shared experts', and the top_k
  copies of each token sent to its experts and their outputs add 2 top_k H T b); without it every block keeps
  its saved tensors;
- LM-head kernel: the design's peak extra memory (flashdapo/kernels/cost.py) at T rows, gradients included;
- gradient reduction: a block's unsharded gradients and the fp32 reduce-scatter input; at the end of
  backward the root's (embedding gradient included);
- the optimizer step: one fp32 temporary of every local element (foreach AdamW on a GPU), or four of the
  largest local tensor (the per-tensor loop over DTensors on a CPU, as torch's memory tracker measures it).
The peak is the resident state plus the largest of these phases (phases that never coexist are not added).

Split placement's staged weights (exact, host memory): each rollout rank stages at most k + 1 versions of the
whole model (rollout.max_lag = k; sync/broadcast.py) in the dtype it loads, the compute dtype; a node
holds that for each of its rollout ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels.cost import fused, generic, naive
from .model import ModelShape

FP32 = 4


@dataclass(frozen=True)
class StateBytes:
    """One rank's FSDP2 state in bytes (exact)."""

    params: int
    grads: int
    moments: int
    steps: int
    """AdamW's per-tensor `step` scalars (fp32, host memory)."""

    @property
    def optimizer(self) -> int:
        return self.moments + self.steps

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(shape: ModelShape, world: int, rank: int = 0, expert_parallel: int = 1) -> StateBytes:
    """Rank `rank`'s parameter, gradient and AdamW bytes: its shards' local elements (rank 0 holds the most),
    routed experts split by `expert_parallel` ranks first."""
    local = sum(t.shard_numel(world, rank, expert_parallel) for t in shape.tensors)
    return StateBytes(params=FP32 * local, grads=FP32 * local, moments=2 * FP32 * local,
                      steps=FP32 * len(shape.tensors))


@dataclass(frozen=True)
class TrainSetup:
    """What the trainer's memory depends on besides the model (from the config and the launch)."""

    world: int
    compute_bytes: int
    """2 for bfloat16 (model.dtype on a GPU), 4 for float32."""
    offload: bool
    checkpointing: bool
    reshard_after_forward: bool
    sequence_parallel: int
    flash_attention: bool
    lm_head: str
    """'generic' or 'fused' (the LM-head design the update uses)."""
    device: str
    """'cuda' or 'cpu': the kernels' chunk plans and whether AdamW runs foreach."""
    expert_parallel: int = 1
    """trainer.expert_parallel: ranks that split each MoE layer's routed experts."""


@dataclass(frozen=True)
class Transients:
    """A micro-batch's modelled transient bytes on one rank, by phase and by part."""

    gathered: int
    kept_activations: int
    recompute: int
    lm_head: int
    layer_reduce: int
    end_of_backward: int
    optimizer_step: int

    @property
    def backward(self) -> int:
        """The largest moment of forward + backward: the LM head's backward, or a block's recompute and
        gradient reduction with the LM head's weight gradient held."""
        return self.gathered + self.kept_activations + max(self.lm_head, self.recompute + self.layer_reduce)

    @property
    def peak(self) -> int:
        return max(self.backward, self.end_of_backward, self.optimizer_step)


def _full(shape: ModelShape, unit: str, world: int, expert_parallel: int = 1) -> int:
    """Elements of `unit` gathered on every rank (padded shards x the ranks gathering them)."""
    return sum(t.gathered_numel(world, expert_parallel) for t in shape.unit_tensors(unit))


def _largest_block(shape: ModelShape, world: int, expert_parallel: int) -> int:
    """Elements of the largest decoder block gathered (MoE and dense blocks may differ)."""
    return max((_full(shape, unit, world, expert_parallel) for unit in shape.layer_units()), default=0)


def block_saved(shape: ModelShape, tokens: int, b: int, flash_attention: bool) -> int:
    """Bytes one decoder block saves for its backward at `tokens` tokens: per token, b x (8 H + 3 K + 4 I)
    (the norms' inputs, rotary q/k and their rotations, v, the attention output and o_proj's input, the
    MLP's gate, up, activation and product; I = `shape.mlp_width`), the key/value heads repeated to the query
    heads where SDPA runs (2 (H - K) more), and each RMSNorm's fp32 normalized copy (2 x 4 H). An MoE layer
    adds each token's top_k copies sent to its experts and their outputs (2 top_k H) and the router's fp32
    logits and probabilities."""
    h, k, i = shape.hidden, shape.kv_dim, shape.mlp_width
    repeated = 0 if flash_attention else 2 * (h - k)
    # the norms' fp32 copies, their rstd, the attention's log-sum-exp
    stats = FP32 * (2 * h + shape.heads + 2)
    moe = shape.moe
    routed = b * 2 * moe.top_k * h + FP32 * 2 * moe.num_experts if moe else 0
    return tokens * (b * (8 * h + 3 * k + 4 * i + repeated) + stats + routed)


def transients(shape: ModelShape, setup: TrainSetup, tokens: int) -> Transients:
    """The modelled transients of a micro-batch of `tokens` tokens on one rank."""
    b, w, h = setup.compute_bytes, setup.world, shape.hidden
    root, block = _full(shape, "root", w), _largest_block(shape, w, setup.expert_parallel)
    blocks_gathered = shape.layers if not setup.reshard_after_forward else min(2, shape.layers)
    # H2D copies of shards
    staged = (FP32 + b) * (root + blocks_gathered * block) // w if setup.offload else 0
    gathered = b * (root + blocks_gathered * block) + staged
    saved = block_saved(shape, tokens, b, setup.flash_attention)
    ulysses = tokens * b * (2 * h + 4 * shape.kv_dim) if setup.sequence_parallel > 1 else 0
    working = tokens * b * (2 * h + 2 * shape.mlp_width)
    if setup.checkpointing:
        kept = tokens * h * b * (shape.layers + 2)  # every block's input, the final norm's input and output
        recompute = saved + ulysses + working
    else:
        kept = shape.layers * (saved + ulysses) + 2 * tokens * h * b
        recompute = working
    lm_head = int(lm_head_cost(setup.lm_head, tokens, h, shape.vocab, b, setup.device).peak_extra_gb * 1e9)
    lm_weight_grad = b * shape.vocab * h  # held from the LM head's backward to the root's reduction
    layer_reduce = (b + FP32) * block + lm_weight_grad
    # params, grads, embedding grad, fp32 RS input
    end = b * root + b * root + b * shape.vocab * h + FP32 * root
    shards = [t.shard_numel(w, 0, setup.expert_parallel) for t in shape.tensors]
    if setup.offload:
        step = 0  # AdamW runs on the host
    elif setup.device == "cuda":
        step = FP32 * sum(shards)
    else:
        step = 4 * FP32 * max(shards)
    return Transients(gathered=gathered, kept_activations=kept, recompute=recompute, lm_head=lm_head,
                      layer_reduce=layer_reduce, end_of_backward=end, optimizer_step=step)


def lm_head_cost(design: str, tokens: int, hidden: int, vocab: int, b: int, device: str):
    """The kernel model's cost of one LM-head forward + backward (`design`: generic, fused, or naive: the
    materialized logits of an HF forward)."""
    if design == "naive":
        return naive(tokens, hidden, vocab)
    model = fused if design == "fused" else generic
    return model(tokens, hidden, vocab, dtype_bytes=b, device=device)


def staged_weights_bytes(shape: ModelShape, max_lag: int, load_bytes: int) -> int:
    """Host bytes one rollout rank of split placement holds in staged weights: k + 1 versions (k = max_lag) of
    every parameter at `load_bytes` each."""
    return (max_lag + 1) * load_bytes * shape.parameters


def rollout_ranks_per_node(rollout_ranks: int, gpus_per_node: int) -> int:
    """The most rollout ranks one node holds: they are the launch's last R ranks, node after node."""
    return min(rollout_ranks, gpus_per_node)


def peak_training_bytes(shape: ModelShape, setup: TrainSetup, tokens: int) -> int:
    """Modelled peak of one rank's device memory in a training step: resident state plus the largest phase."""
    state = state_bytes(shape, setup.world, expert_parallel=setup.expert_parallel)
    resident = 0 if setup.offload else state.params + state.grads + state.moments
    return resident + transients(shape, setup, tokens).peak


def first_step_peak_bytes(shape: ModelShape, setup: TrainSetup, tokens: int, rank: int = 0) -> int:
    """Modelled peak of a fresh optimizer's first step (what the validation measures): the forward and
    backward hold no gradients or AdamW moments yet; the step holds both, then its temporaries."""
    state = state_bytes(shape, setup.world, rank, setup.expert_parallel)
    t = transients(shape, setup, tokens)
    if setup.offload:
        return max(t.backward, t.end_of_backward)
    return max(state.params + max(t.backward, t.end_of_backward),
               state.params + state.grads + state.moments + t.optimizer_step)


__all__ = [
    "StateBytes", "first_step_peak_bytes", "lm_head_cost", "TrainSetup", "Transients", "block_saved",
    "peak_training_bytes", "rollout_ranks_per_node", "staged_weights_bytes", "state_bytes", "transients"
]

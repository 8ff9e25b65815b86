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

LoRA (lora.rank r > 0; the shape holds the adapters, plan/model.py): the frozen base is held in the compute
dtype (b bytes a local element; bf16 on a GPU: no fp32 master copy, no gradients, no AdamW moments), the
adapters as above (fp32 parameters, gradients and two moments: 16 bytes a local element, a `step` per
adapter tensor). FSDP2 shards both over all ranks. Transients: the gathered blocks include their adapters
(cast to b), each adapted linear's backward saves its A output [T, r] (and with lora.dropout > 0 the dropped
input and its mask), the adapter path adds one input gradient [T, in] in a block's backward; the gradient
reduction carries only the adapters' gradients, the frozen LM head has no weight gradient (the kernels skip
dW when the weight does not require grad: `lm_head_cost(weight_grad=False)`), the optimizer steps only the
adapters.

Split placement's staged weights (exact, host memory): each rollout rank stages at most k + 1 versions of the
whole model (rollout.max_lag = k; sync/broadcast.py), under LoRA of the adapters alone, in the dtype it
loads, the compute dtype; a node holds that for each of its rollout ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..kernels.chunked import plan_chunks
from ..kernels.cost import GB, Cost, fused, generic, naive
from ..kernels.fused import TILE_VOCAB, fused_chunk_tokens
from .model import ModelShape

FP32 = 4


@dataclass(frozen=True)
class StateBytes:
    """One rank's FSDP2 state in bytes (exact)."""

    params: int
    """Every local parameter byte (under LoRA the frozen base's, in the compute dtype, included)."""
    grads: int
    moments: int
    steps: int
    """AdamW's per-tensor `step` scalars (fp32, host memory)."""
    frozen: int = 0
    """LoRA: the frozen base's part of `params` (0: everything trains)."""

    @property
    def trainable_params(self) -> int:
        """The fp32 parameters that train (the adapters under LoRA)."""
        return self.params - self.frozen

    @property
    def optimizer(self) -> int:
        return self.moments + self.steps

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(shape: ModelShape, world: int, rank: int = 0, expert_parallel: int = 1,
                frozen_bytes: int = 2) -> StateBytes:
    """Rank `rank`'s parameter, gradient and AdamW bytes: its shards' local elements (rank 0 holds the most),
    routed experts split by `expert_parallel` ranks first. Under LoRA the frozen base's elements are
    `frozen_bytes` each (the compute dtype) with no gradients or moments; the adapters train in fp32."""
    trainable = [t for t in shape.tensors if shape.trainable(t)]
    local = sum(t.shard_numel(world, rank, expert_parallel) for t in trainable)
    frozen = frozen_bytes * sum(t.shard_numel(world, rank, expert_parallel) for t in shape.tensors
                                if not shape.trainable(t))
    return StateBytes(params=FP32 * local + frozen, grads=FP32 * local, moments=2 * FP32 * local,
                      steps=FP32 * len(trainable), frozen=frozen)


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
    lora_dropout: float = 0.0
    """lora.dropout (LoRA: the dropped adapter inputs and their masks are saved for backward)."""


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


def _full(shape: ModelShape, unit: str, world: int, expert_parallel: int = 1, trainable: bool = False) -> int:
    """Elements of `unit` gathered on every rank (padded shards x the ranks gathering them); `trainable`:
    of its trainable tensors only (those with gradients)."""
    return sum(t.gathered_numel(world, expert_parallel) for t in shape.unit_tensors(unit)
               if not trainable or shape.trainable(t))


def _largest_block(shape: ModelShape, world: int, expert_parallel: int, trainable: bool = False) -> int:
    """Elements of the largest decoder block gathered (MoE and dense blocks may differ)."""
    return max((_full(shape, unit, world, expert_parallel, trainable) for unit in shape.layer_units()),
               default=0)


def _adapted_linears(shape: ModelShape) -> list[tuple[int, int]]:
    """(rank, input width) of each adapted linear of the most adapted decoder block (its lora_A tensors)."""
    per_unit: dict[str, list[tuple[int, int]]] = {}
    for t in shape.tensors:
        if t.adapter and ".lora_A." in t.name:
            per_unit.setdefault(t.unit, []).append(t.shape)
    return max(per_unit.values(), key=lambda a: sum(r + i for r, i in a), default=[])


def block_saved(shape: ModelShape, tokens: int, b: int, flash_attention: bool,
                lora_dropout: float = 0.0) -> int:
    """Bytes one decoder block saves for its backward at `tokens` tokens: per token, b x (8 H + 3 K + 4 I)
    (the norms' inputs, rotary q/k and their rotations, v, the attention output and o_proj's input, the
    MLP's gate, up, activation and product; I = `shape.mlp_width`), the key/value heads repeated to the query
    heads where SDPA runs (2 (H - K) more), and each RMSNorm's fp32 normalized copy (2 x 4 H). An MoE layer
    adds each token's top_k copies sent to its experts and their outputs (2 top_k H) and the router's fp32
    logits and probabilities. Under LoRA each adapted linear saves its A output [T, r] for B's weight
    gradient (A's input is the linear's input, counted already), and with lora.dropout > 0 the dropped input
    (b) and its mask (1 byte) per input element."""
    h, k, i = shape.hidden, shape.kv_dim, shape.mlp_width
    repeated = 0 if flash_attention else 2 * (h - k)
    # the norms' fp32 copies, their rstd, the attention's log-sum-exp
    stats = FP32 * (2 * h + shape.heads + 2)
    moe = shape.moe
    routed = b * 2 * moe.top_k * h + FP32 * 2 * moe.num_experts if moe else 0
    adapted = _adapted_linears(shape)
    lora = b * sum(r for r, _ in adapted) + (b + 1) * sum(w for _, w in adapted) * (lora_dropout > 0)
    return tokens * (b * (8 * h + 3 * k + 4 * i + repeated) + stats + routed + lora)


def transients(shape: ModelShape, setup: TrainSetup, tokens: int) -> Transients:
    """The modelled transients of a micro-batch of `tokens` tokens on one rank."""
    b, w, h = setup.compute_bytes, setup.world, shape.hidden
    root, block = _full(shape, "root", w), _largest_block(shape, w, setup.expert_parallel)
    blocks_gathered = shape.layers if not setup.reshard_after_forward else min(2, shape.layers)
    # H2D copies of shards: fp32 masters and their cast; under LoRA the frozen base needs no cast
    trained = (_full(shape, "root", w, trainable=True)
               + blocks_gathered * _largest_block(shape, w, setup.expert_parallel, trainable=True))
    frozen = root + blocks_gathered * block - trained
    staged = ((FP32 + b) * trained + b * frozen) // w if setup.offload else 0
    gathered = b * (root + blocks_gathered * block) + staged
    saved = block_saved(shape, tokens, b, setup.flash_attention, setup.lora_dropout)
    ulysses = tokens * b * (2 * h + 4 * shape.kv_dim) if setup.sequence_parallel > 1 else 0
    working = tokens * b * (2 * h + 2 * shape.mlp_width)
    if shape.lora:  # the adapter path's input gradient, before it is added to the base's
        working += tokens * b * max((i for _, i in _adapted_linears(shape)), default=0)
    if setup.checkpointing:
        kept = tokens * h * b * (shape.layers + 2)  # every block's input, the final norm's input and output
        recompute = saved + ulysses + working
    else:
        kept = shape.layers * (saved + ulysses) + 2 * tokens * h * b
        recompute = working
    head_trains = not shape.lora  # under LoRA the LM head and the embedding are frozen
    lm_head = int(lm_head_cost(setup.lm_head, tokens, h, shape.vocab, b, setup.device,
                               weight_grad=head_trains).peak_extra_gb * 1e9)
    lm_weight_grad = b * shape.vocab * h if head_trains else 0  # held to the root's reduction
    trained_block = _largest_block(shape, w, setup.expert_parallel, trainable=True)
    layer_reduce = (b + FP32) * trained_block + lm_weight_grad
    # params, grads, embedding grad, fp32 RS input (a frozen root: its gathered params alone)
    end = b * root + ((b * root + b * shape.vocab * h + FP32 * root) if head_trains else 0)
    shards = [t.shard_numel(w, 0, setup.expert_parallel) for t in shape.tensors if shape.trainable(t)]
    if setup.offload:
        step = 0  # AdamW runs on the host
    elif setup.device == "cuda":
        step = FP32 * sum(shards)
    else:
        step = 4 * FP32 * max(shards, default=0)
    return Transients(gathered=gathered, kept_activations=kept, recompute=recompute, lm_head=lm_head,
                      layer_reduce=layer_reduce, end_of_backward=end, optimizer_step=step)


def lm_head_cost(design: str, tokens: int, hidden: int, vocab: int, b: int, device: str,
                 weight_grad: bool = True) -> Cost:
    """The kernel model's cost of one LM-head forward + backward (`design`: generic, fused, or naive: the
    materialized logits of an HF forward); `weight_grad` False: a frozen head (LoRA), see `frozen_head`."""
    if design == "naive":
        cost = naive(tokens, hidden, vocab)
    else:
        model = fused if design == "fused" else generic
        cost = model(tokens, hidden, vocab, dtype_bytes=b, device=device)
    return cost if weight_grad else frozen_head(cost, design, tokens, hidden, vocab, b, device)


def frozen_head(cost: Cost, design: str, n: int, h: int, v: int, b: int, device: str) -> Cost:
    """`cost` (kernels/cost.py, every row live) without the head's weight gradient: both drivers skip dW
    when the weight does not require grad (fused.py `_sweep`, chunked.py `_backward`: `need[1]`). The fused
    sweep loses its dW GEMM (6 -> 4 N H V), its fp32 accumulator (4 V H: zero fill, peak) and the cast to
    W's dtype ((4 + b) V H); the generic driver its dW GEMM (8 -> 6 N H V) and dW (b V H) in the backward
    loop and at its end; the naive path its dW GEMM and fp32 dW (4 V H). The formulas are cost.py's with
    those terms removed."""
    if design == "fused":
        c, bv = fused_chunk_tokens(n, v, device), min(TILE_VOCAB, v)
        peak = max(4 * c * v + b * c * bv + 4 * c * h + b * n * h, b * n * h) + 16 * n
        gemm, exposed = 4 * n * h * v, cost.exposed_gb * GB - (8 + b) * v * h
    elif design == "naive":
        peak, gemm, exposed = cost.peak_extra_gb * GB - 4 * v * h, 4 * n * h * v, cost.exposed_gb * GB
    else:
        plan = plan_chunks(n, v, device, dz_bytes=b)
        bn, bv = min(n, plan.chunk_tokens), plan.chunk_vocab
        loop = 4 * n * h + b * n * bv + 4 * bn * bv
        peak = max(loop, (4 + b) * n * h, 4 * plan.chunk_tokens * plan.chunk_vocab) + 12 * n
        gemm, exposed = 6 * n * h * v, cost.exposed_gb * GB
    grads = (2 if design == "naive" else b) * n * h  # dh (naive: cost.py's 2 bytes an element)
    return dataclasses.replace(cost, gemm_tflop=gemm / 1e12, exposed_gb=exposed / GB, peak_extra_gb=peak / GB,
                               workspace_gb=(peak - grads) / GB)


def staged_weights_bytes(shape: ModelShape, max_lag: int, load_bytes: int) -> int:
    """Host bytes one rollout rank of split placement holds in staged weights: k + 1 versions (k = max_lag) of
    every parameter at `load_bytes` each; under LoRA of the adapters alone (both sides build the frozen base:
    sync/broadcast.py)."""
    pushed = shape.trainable_parameters
    return (max_lag + 1) * load_bytes * pushed


def rollout_ranks_per_node(rollout_ranks: int, gpus_per_node: int) -> int:
    """The most rollout ranks one node holds: they are the launch's last R ranks, node after node."""
    return min(rollout_ranks, gpus_per_node)


def setup_state(shape: ModelShape, setup: TrainSetup, rank: int = 0) -> StateBytes:
    """Rank `rank`'s state under `setup` (the frozen base in its compute dtype under LoRA)."""
    return state_bytes(shape, setup.world, rank, setup.expert_parallel, setup.compute_bytes)


def peak_training_bytes(shape: ModelShape, setup: TrainSetup, tokens: int) -> int:
    """Modelled peak of one rank's device memory in a training step: resident state plus the largest phase."""
    state = setup_state(shape, setup)
    resident = 0 if setup.offload else state.params + state.grads + state.moments
    return resident + transients(shape, setup, tokens).peak


def first_step_peak_bytes(shape: ModelShape, setup: TrainSetup, tokens: int, rank: int = 0) -> int:
    """Modelled peak of a fresh optimizer's first step (what the validation measures): the forward and
    backward hold no gradients or AdamW moments yet; the step holds both, then its temporaries."""
    state = setup_state(shape, setup, rank)
    t = transients(shape, setup, tokens)
    if setup.offload:
        return max(t.backward, t.end_of_backward)
    return max(state.params + max(t.backward, t.end_of_backward),
               state.params + state.grads + state.moments + t.optimizer_step)


__all__ = [
    "StateBytes", "first_step_peak_bytes", "frozen_head", "lm_head_cost", "TrainSetup", "Transients",
    "block_saved", "peak_training_bytes", "rollout_ranks_per_node", "setup_state", "staged_weights_bytes",
    "state_bytes", "transients"
]

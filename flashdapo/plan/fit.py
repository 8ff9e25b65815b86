"""The memory plan of one launch on one GPU: the trainer's and the engine's bytes per rank, whether each
phase of a step fits (generation, training, the engine's start), and the biggest micro-batch that does.

A refusal is a `PlanError`: one line naming the phase, what it needs, and the field to change."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, engine_spec
from ..errors import FlashdapoError
from ..kernels.gpus import GPU
from ..kernels.lm_head_choice import lm_head_design
from .engine import EngineMemory, engine_memory
from .memory import (
    StateBytes,
    TrainSetup,
    Transients,
    peak_training_bytes,
    rollout_ranks_per_node,
    setup_state,
    staged_weights_bytes,
    transients,
)
from .model import ModelShape

GIB = 2**30
SEARCH_LIMIT = 1 << 22
"""The largest micro-batch the search tries (tokens per rank)."""
CONTEXT_GIB = 0.5
"""The trainer process's CUDA context and allocator slack on each GPU (modelled)."""


class PlanError(FlashdapoError):
    """The launch cannot start or does not fit; the message names why and what to change."""

    label = "cannot launch"


@dataclass(frozen=True)
class MemoryPlan:
    """Everything the report prints about memory (bytes per rank)."""

    state: StateBytes
    setup: TrainSetup
    tokens: int
    """This rank's largest micro-batch (trainer.micro_batch_tokens, or a longer sequence's share)."""
    transients: Transients
    train_peak: int
    engine: EngineMemory | None
    context: int
    training_total: int
    generation_total: int
    best_tokens: int
    """The biggest trainer.micro_batch_tokens whose training phase fits (0: none)."""
    gpu: GPU
    staged: int = 0
    """Split placement: one rollout rank's staged weights in host memory (exact; 0 in co-located
    placement)."""
    host_memory: int | None = None
    """A node's host memory when the GPU table records it (`node_host_memory`), else None: not checked."""

    @property
    def resident(self) -> int:
        """The trainer's state on the GPU between steps: parameters (under LoRA the frozen base and the
        adapters) and AdamW moments (gradients are freed)."""
        return 0 if self.setup.offload else self.state.params + self.state.moments


def train_setup(cfg: Config, world: int, shape: ModelShape, gpu: GPU, tokens: int) -> TrainSetup:
    """The trainer's memory-relevant settings on `gpu` (model.dtype auto is bfloat16 there)."""
    b = 4 if cfg.model.dtype == "float32" else 2
    return TrainSetup(world=world, compute_bytes=b, offload=cfg.trainer.fsdp_cpu_offload,
                      checkpointing=cfg.model.gradient_checkpointing,
                      reshard_after_forward=cfg.trainer.reshard_after_forward,
                      sequence_parallel=cfg.trainer.sequence_parallel,
                      flash_attention=cfg.model.attn_implementation == "flash_attention_2",
                      lm_head=lm_head_design(gpu, tokens, shape.hidden, shape.vocab), device="cuda",
                      expert_parallel=cfg.trainer.expert_parallel, lora_dropout=cfg.lora.dropout)


def largest_micro_batch(cfg: Config) -> int:
    """Tokens per rank of the largest micro-batch: the budget, or a longer sequence's 1/sp share (a sequence
    over sp x the budget gets a micro-batch of its own)."""
    longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length - 1
    return max(cfg.trainer.micro_batch_tokens, -(-longest // cfg.trainer.sequence_parallel))


def node_host_memory(gpu: GPU) -> int | None:
    """A node's host memory in bytes when the GPU table records one for `gpu`'s nodes (a `host_memory_gib`
    figure; kernels/gpus.py records none yet), else None."""
    gib = getattr(gpu, "host_memory_gib", None)
    return int(gib * GIB) if gib else None


def memory_plan(cfg: Config, world: int, shape: ModelShape, gpu: GPU, check: bool = True,
                gpus_per_node: int = 0) -> MemoryPlan:
    """The memory plan; with `check`, refusing (PlanError) a phase that does not fit. `gpus_per_node` places
    split placement's rollout ranks on nodes (0: all `world` ranks on one node, the most it can hold)."""
    tokens = largest_micro_batch(cfg)
    setup = train_setup(cfg, world, shape, gpu, tokens)
    state = setup_state(shape, setup)
    context = int(CONTEXT_GIB * GIB)
    peak = peak_training_bytes(shape, setup, tokens) + context
    engine = engine_memory(shape, cfg, gpu.memory_bytes) if engine_spec(
        cfg.rollout.engine).own_weights else None
    asleep = engine.asleep if engine else 0
    resident = 0 if setup.offload else state.params + state.moments
    generation = resident + context + (engine.budget if engine else 0)
    best = _best_tokens(shape, setup, gpu.memory_bytes - context - asleep)
    plan = MemoryPlan(state=state, setup=setup, tokens=tokens, transients=transients(shape, setup, tokens),
                      train_peak=peak, engine=engine, context=context, training_total=peak + asleep,
                      generation_total=generation, best_tokens=best, gpu=gpu,
                      staged=staged_weights_bytes(shape, cfg.rollout.max_lag, setup.compute_bytes)
                      if cfg.rollout.placement == "split" else 0, host_memory=node_host_memory(gpu))
    if check:
        _check_fit(plan, cfg)
        _check_host(plan, cfg, gpus_per_node or world)
    return plan


def _best_tokens(shape: ModelShape, setup: TrainSetup, room: int) -> int:
    """The largest token count whose modelled training peak fits `room` bytes (binary search; monotone)."""
    fits = lambda t: peak_training_bytes(shape, setup, t) <= room
    if not fits(1):
        return 0
    low, high = 1, SEARCH_LIMIT
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _gib(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


def _check_fit(plan: MemoryPlan, cfg: Config) -> None:
    total, gpu, e = plan.gpu.memory_bytes, plan.gpu.name, plan.engine
    if e is not None:
        need = e.kv_per_token * e.max_model_len
        if e.kv_cache < need:
            raise PlanError(
                f"rollout.gpu_memory_utilization: {cfg.rollout.gpu_memory_utilization} of an {gpu} leaves "
                f"vLLM a {_gib(e.kv_cache)} KV cache after {_gib(e.weights)} of weights (modelled), not one "
                f"request of {e.max_model_len} tokens ({_gib(need)}; vLLM refuses to start): raise it or "
                "rollout.tensor_parallel_size, or lower data.max_prompt_length + rollout.max_response_length")
        at_start = (0 if plan.setup.offload else plan.state.params) + plan.context + e.budget
        if at_start > total:
            raise PlanError(
                f"rollout.gpu_memory_utilization: vLLM asks {_gib(e.budget)} free at start while the "
                f"trainer holds {_gib(at_start - e.budget)} of an {gpu}'s {_gib(total)} (modelled): lower "
                "it, "
                "set trainer.fsdp_cpu_offload=true, or launch more GPUs")
    if plan.generation_total > total:
        raise PlanError(
            f"generation needs {_gib(plan.generation_total)} of an {gpu}'s {_gib(total)} (modelled: the "
            f"trainer's parameters and AdamW moments {_gib(plan.resident)} + vLLM's "
            f"{_gib(e.budget if e else 0)}): lower rollout.gpu_memory_utilization, set "
            "trainer.fsdp_cpu_offload=true, or launch more GPUs")
    if plan.training_total > total:
        if plan.best_tokens == 0:
            raise PlanError(
                f"training needs more than an {gpu}'s {_gib(total)} at any micro-batch (modelled: state "
                f"{_gib(plan.resident + plan.state.grads)}): set trainer.fsdp_cpu_offload=true or launch "
                "more GPUs")
        raise PlanError(
            f"trainer.micro_batch_tokens: {plan.tokens} tokens per rank need {_gib(plan.training_total)} "
            f"of an {gpu}'s {_gib(total)} in training (modelled); the biggest that fits is "
            f"{plan.best_tokens} (a sequence of data.max_prompt_length + rollout.max_response_length "
            "tokens over trainer.sequence_parallel must fit too)")


def _check_host(plan: MemoryPlan, cfg: Config, gpus_per_node: int) -> None:
    """Split placement's staged weights against a node's host memory, when the GPU table knows it."""
    ranks = rollout_ranks_per_node(cfg.rollout.rollout_ranks, gpus_per_node)
    need = plan.staged * ranks
    if plan.host_memory is not None and need > plan.host_memory:
        raise PlanError(
            f"rollout.max_lag: split placement stages {cfg.rollout.max_lag + 1} versions of the weights "
            f"in host memory on each rollout rank ({_gib(plan.staged)}, exact), {_gib(need)} for the "
            f"{ranks} rollout ranks of a node, over a node's {_gib(plan.host_memory)}: lower "
            "rollout.max_lag, or put fewer rollout ranks on a node")


__all__ = ["MemoryPlan", "PlanError", "largest_micro_batch", "memory_plan", "node_host_memory", "train_setup"]

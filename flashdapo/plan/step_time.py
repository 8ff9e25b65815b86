"""A modelled training step: generation (decode roofline), old log-probs, the update, the LM-head kernel.

Every figure here is modelled, from stated assumptions (`Workload`), never measured:
- generation, per round of trainer.gen_batch prompts x rollout.n responses: each engine (tensor_parallel_size
  ranks) decodes its share; a decode step reads the rank's weight shard once and the KV cache of every
  running sequence, at the GPU's datasheet HBM bandwidth (a roofline: no kernel reaches it). Responses run
  together as far as the KV cache holds them; the round lasts until the longest response
  (rollout.max_response_length) is done. Lengths uniform on [0, 2 x mean] (so E[len^2] = 4/3 mean^2). Prefill
  once per prompt (prefix caching shares it over the n responses) at the stated MFU;
- old log-probs (when the update needs them, algorithm.on_policy): a forward of every kept token, 2 FLOPs per
  parameter outside the LM head per token plus causal attention 2 s^2 H per layer and sequence; for a
  mixture-of-experts model the parameters a token runs through (`ModelShape.active_parameters`: top-k of the
  routed experts, all the rest), also in prefill;
- update: 6 FLOPs per parameter per token (8 with gradient checkpointing: the forward again), attention 3x
  its forward (4x), at the stated MFU, per PPO epoch. Under LoRA the frozen base's linears skip their
  weight-gradient GEMMs (2 of the 4 backward FLOPs per parameter and token): 4 FLOPs per base parameter (6
  with checkpointing), the adapters 6 (8) like any trained parameter, and their forward (2 per adapter
  parameter and token) counts wherever the model's does; attention has no weights: unchanged;
- LM head: flashdapo/kernels/cost.py's time of the design the trainer uses, at this GPU's rates, per
  micro-batch (a frozen head under LoRA: without its dW GEMM, plan/memory.py `frozen_head`);
- expert parallelism's token all-to-all in the trainer's forwards and backwards (plan/all_to_all.py), not
  overlapped.
The weight push's bytes are counted (`push_bytes`), not timed. Not modelled: the weight push's time, FSDP2
and Ulysses communication (assumed overlapped), CPU offload traffic, rewards, and extra generation rounds
when dynamic sampling keeps too few groups. Decoding reads every weight of the engine's shard per step (an
MoE engine's many sequences touch nearly every expert).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..algorithm import on_policy
from ..config import Config
from ..kernels.gpus import GPU
from .all_to_all import all_to_all_bytes, all_to_all_seconds, forward_exchanges, links_of
from .engine import EngineMemory, torch_engine_memory
from .memory import lm_head_cost
from .model import ModelShape


@dataclass(frozen=True)
class Workload:
    """The stated assumptions of the time model."""

    mean_response: int
    mean_prompt: int
    mfu: float
    """Model FLOPs utilization of the dense forward/backward and prefill (of the bf16 dense peak)."""


@dataclass(frozen=True)
class StepTime:
    """Modelled seconds of one training step, by stage."""

    generation: float
    decode_steps: int
    concurrent: int
    old_logprobs: float
    update: float
    lm_head: float
    all_to_all: float = 0.0
    """Expert parallelism's token exchange (0: dense, or trainer.expert_parallel 1)."""
    all_to_all_bytes: float = 0.0
    """Bytes that leave one rank in it per step."""

    @property
    def total(self) -> float:
        return self.generation + self.old_logprobs + self.update + self.lm_head + self.all_to_all


def _attention_flops(shape: ModelShape, sequences: float, mean_len_sq: float) -> float:
    """Causal attention forward FLOPs: QK^T and PV, 2 s^2 H each, half of it masked, per layer."""
    return sequences * 2 * mean_len_sq * shape.hidden * shape.layers


def step_time(shape: ModelShape, cfg: Config, world: int, gpu: GPU, engine: EngineMemory | None,
              lm_design: str, work: Workload, gpus_per_node: int = 0) -> StepTime:
    """The modelled step time of `cfg` on `world` ranks of `gpu` (`engine` None: the torch engine),
    `gpus_per_node` to a node (0: one node)."""
    engine = engine or torch_engine_memory(shape, cfg)
    tc, rc = cfg.trainer, cfg.rollout
    p, mu, longest = work.mean_prompt, work.mean_response, rc.max_response_length
    len_sq = min(4 / 3 * mu**2, longest**2)
    flops = gpu.bf16_tflops * 1e12 * work.mfu
    # The embedding is a lookup and the LM head is the kernel's: neither is a dense FLOP per parameter. A
    # token runs through its top-k routed experts only (active parameters).
    dense = shape.active_parameters - shape.lm_head_parameters * (1 if shape.tied else 2)

    engines = world // rc.tensor_parallel_size
    responses = tc.gen_batch * rc.n / engines
    kv_tokens = engine.kv_cache / max(1, engine.kv_per_token)
    concurrent = max(1, min(int(responses), int(kv_tokens // (p + mu))))
    steps = max(longest, math.ceil(responses * mu / concurrent))
    kv_read = responses * (p * mu + len_sq / 2) * engine.kv_per_token
    decode = (steps * engine.weights + kv_read) / (gpu.hbm_tbps * 1e12)
    prefill = 2 * shape.active_parameters / rc.tensor_parallel_size * (tc.gen_batch / engines) * p / flops
    generation = decode + prefill

    sequences = tc.train_batch * rc.n / world  # kept responses per rank (sp shares a slot's rows 1/sp each)
    tokens = sequences * (p + mu)
    seq_sq = p**2 + 2 * p * mu + len_sq
    attention = _attention_flops(shape, sequences, seq_sq)
    forward = 2 * dense * tokens + attention
    old = 0.0 if on_policy(cfg) or cfg.algorithm.old_logprobs == "rollout" else forward / flops
    ckpt = cfg.model.gradient_checkpointing
    trained = shape.adapter_parameters if shape.lora else dense  # LoRA: the base's linears skip dW
    per_token = (8 if ckpt else 6) * trained + (6 if ckpt else 4) * (dense - trained)
    update = tc.ppo_epochs * (per_token * tokens + (4 if ckpt else 3) * attention) / flops

    micro = max(1, math.ceil(tokens / tc.micro_batch_tokens))
    rows = int(sequences * mu / micro)  # response tokens per micro-batch: the LM head's rows
    rates = gpu.kernel_rates()
    per_micro = lm_head_cost(lm_design, max(rows, 1), shape.hidden, shape.vocab, 2, "cuda",
                             weight_grad=not shape.lora)
    per_micro_ms = per_micro.gemm_tflop / rates.gemm_tflops * 1e3 + per_micro.exposed_gb / rates.hbm_tbps
    lm_forward = (2 * rows * shape.hidden * shape.vocab / (rates.gemm_tflops * 1e12)
                  + 4 * rows * shape.vocab / (rates.hbm_tbps * 1e12))
    lm_head = micro * (tc.ppo_epochs * per_micro_ms / 1e3 + (lm_forward if old else 0.0))
    forwards = forward_exchanges(ckpt, tc.ppo_epochs, old > 0)
    sent = all_to_all_bytes(shape, tokens, tc.expert_parallel, 4 if cfg.model.dtype == "float32" else 2,
                            forwards)
    exchange = all_to_all_seconds(sent, tc.expert_parallel, gpus_per_node, links_of(gpu))
    return StepTime(generation=generation, decode_steps=steps, concurrent=concurrent, old_logprobs=old,
                    update=update, lm_head=lm_head, all_to_all=exchange, all_to_all_bytes=sent)


def push_bytes(shape: ModelShape, cfg: Config) -> int:
    """Bytes the trainer hands an engine with its own weights (vLLM) per weight push, exact: every parameter
    in the compute dtype (the engine's weight dtype), or under LoRA the adapters and trained norms alone, fp32
    as sync/__init__.py `WeightSource.adapters` gathers them (the frozen base is never pushed)."""
    if shape.lora:
        return 4 * shape.trainable_parameters
    return (4 if cfg.model.dtype == "float32" else 2) * shape.parameters


__all__ = ["StepTime", "Workload", "push_bytes", "step_time"]

"""The co-located vLLM engine's memory per rank (modelled): weights per tensor-parallel shard, its
activation and runtime reserve, and the KV cache left at rollout.gpu_memory_utilization, as vLLM sizes
it (v1 worker: KV cache = utilization x total - weights - peak activations - non-torch memory), and what
its sleep frees.

vLLM's own start-up checks are modelled here rather than called (vLLM is not needed to plan): the query
heads divide by the tensor-parallel size (`ModelConfig.verify_with_parallel_config`), the KV cache holds
at least one request of max_model_len tokens (`v1/core/kv_cache_utils.py` `check_enough_kv_cache_memory`),
and the fraction asked for is free when the engine starts (the worker's start-up snapshot).

Under LoRA the engine holds the base and one adapter slot (max_loras 1 at the adapters' rank, which is
one of the max_lora_rank sizes vLLM takes for the usual ranks 8 ... 256), both bf16 over
tensor_parallel_size ranks: `shape.parameters` counts the adapters too (plan/model.py). It sleeps at level 1
whatever rollout.sleep_level says (the base came from disk and is never pushed, so it must not be
discarded): the weights wait in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config
from .model import ModelShape

BF16 = 2
RUNTIME_GIB = 2.5
"""CUDA context, CUDA-graph pool and NCCL buffers of an engine (docs/vllm.md: ~2-3 GB measured asleep)."""


@dataclass(frozen=True)
class EngineMemory:
    """One rank's share of a co-located vLLM engine (bytes, modelled)."""

    weights: int
    activations: int
    runtime: int
    budget: int
    """rollout.gpu_memory_utilization x the GPU's memory (or weights + activations + runtime +
    kv_cache_gib)."""
    kv_cache: int
    kv_per_token: int
    max_model_len: int
    sleep_level: int

    @property
    def sequences(self) -> int:
        """Requests of max_model_len tokens the KV cache holds at once."""
        return self.kv_cache // max(1, self.kv_per_token * self.max_model_len)

    @property
    def asleep(self) -> int:
        """What stays on the GPU while the engine sleeps (level 1 moves the weights to host memory, level 2
        discards them; both free the KV cache)."""
        return self.runtime


def kv_bytes_per_token(shape: ModelShape, tp: int) -> int:
    """bf16 K and V of every layer for one token on one rank: KV heads split over tp (replicated when tp
    exceeds them, as vLLM does), each layer's own heads and head dim (they vary in Gemma 4)."""
    return sum(2 * max(1, kv // tp) * dim * BF16 for kv, dim in shape.layer_kv)


def engine_memory(shape: ModelShape, cfg: Config, gpu_bytes: int) -> EngineMemory:
    """The engine's modelled memory on one rank of a GPU of `gpu_bytes`."""
    rc, tp = cfg.rollout, cfg.rollout.tensor_parallel_size
    weights = BF16 * shape.parameters // tp
    tokens = rc.max_num_batched_tokens
    # vLLM's profiling forward at max_num_batched_tokens: the widest per-token tensors of a block (the
    # MLP's gate and up, an MoE layer's over its top-k experts, the residual stream and qkv) plus the
    # sampler's fp32 logits of 256 rows.
    activations = tokens * BF16 * (2 * shape.mlp_width // tp + 4 * shape.hidden) + 256 * shape.vocab * 4 * 2
    runtime = int(RUNTIME_GIB * 2**30)
    if rc.kv_cache_gib > 0:
        kv = int(rc.kv_cache_gib * 2**30)
        budget = weights + activations + runtime + kv
    else:
        budget = int(rc.gpu_memory_utilization * gpu_bytes)
        kv = max(0, budget - weights - activations - runtime)
    return EngineMemory(weights=weights, activations=activations, runtime=runtime, budget=budget, kv_cache=kv,
                        kv_per_token=kv_bytes_per_token(shape, tp),
                        max_model_len=cfg.data.max_prompt_length + rc.max_response_length,
                        sleep_level=1 if shape.lora else rc.sleep_level)


def torch_engine_memory(shape: ModelShape, cfg: Config) -> EngineMemory:
    """The torch engine for the time model: it samples through the FSDP2 policy (every block gathered per
    decode step: the whole bf16 model read) with a cache of rollout.max_num_seqs sequences."""
    rc = cfg.rollout
    max_len = cfg.data.max_prompt_length + rc.max_response_length
    per_token = kv_bytes_per_token(shape, 1)
    kv = rc.max_num_seqs * max_len * per_token
    return EngineMemory(weights=BF16 * shape.parameters, activations=0, runtime=0, budget=kv, kv_cache=kv,
                        kv_per_token=per_token, max_model_len=max_len, sleep_level=0)


__all__ = ["EngineMemory", "RUNTIME_GIB", "engine_memory", "kv_bytes_per_token", "torch_engine_memory"]

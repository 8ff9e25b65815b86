"""The one place a rollout engine is built: training (co-located), split placement's rollout side, eval,
generate and the ablation's base statistics all call `build_engine`.

Adding an engine is a module in rollout/, its spec in config/engines.py, and one branch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import RolloutConfig
from ..distributed.mesh import DistEnv, before_destroy
from ..tokenizer import describe_stop_ids, eos_token_ids
from .base import RolloutEngine


def build_engine(rollout: RolloutConfig, env: DistEnv, tokenizer, *, model: nn.Module | None = None,
                 model_path: str | None = None, dtype: str = "float32", seed: int = 0,
                 max_model_len: int | None = None, shard_group: dist.ProcessGroup | None = None,
                 reshard_after_forward: bool = True, verify_push: Any = None, error_log: Path | None = None,
                 dummy_weights: bool = True, vllm_module: Any = None,
                 record_routes: bool = False, batch_invariant: bool = False) -> RolloutEngine:
    """The engine `rollout.engine` names, on this rank.

    torch: samples from `model` itself (the FSDP2 policy, a full HF replica, or a sharded model whose forwards
    gather over `shard_group`), `rollout.max_num_seqs` sequences at a time. vllm: its own copy of the model at
    `model_path` in `dtype` (dummy weights until the first push unless `dummy_weights` is False),
    `verify_push(engine)` after every push (the push check), its shutdown registered before the process
    group's; where `model` carries LoRA adapters (models/lora.py), vLLM serves them over the base it loads
    from `model_path` and each push gives it only the adapters. Both stop on the same ids
    (tokenizer.eos_token_ids: the tokenizer's eos, `model_path`'s generation_config.json eos_token_id, the
    chat template's end-of-turn token), named in one line at start on rank 0. `record_routes`: the engine also
    returns the experts it routed every position to (algorithm.routing_replay=r3). `batch_invariant`
    (trainer.batch_invariant): vLLM in its batch-invariant mode, its sampled log-probs from flashdapo's kernel
    (vllm_invariant.py); the torch engine's model is made invariant where it is built (models/invariant.py).
    """
    stop_ids = eos_token_ids(tokenizer, model_path)
    if env.rank == 0:
        print(f"flashdapo: {rollout.engine} rollouts stop at {describe_stop_ids(tokenizer, stop_ids)}",
              flush=True)
    if rollout.engine == "vllm":
        from ..models.lora import layout_of
        from .vllm_engine import VLLMEngine

        lora = layout_of(getattr(model, "hf", model)) if model is not None else None
        engine = VLLMEngine(rollout, model_path, rank=env.rank, world_size=env.world_size,
                            local_rank=env.local_rank, dtype=dtype, seed=seed, max_model_len=max_model_len,
                            dummy_weights=dummy_weights, verify_push=verify_push, vllm_module=vllm_module,
                            error_log=error_log, stop_token_ids=stop_ids, record_routes=record_routes,
                            batch_invariant=batch_invariant,
                            **({"lora": lora} if lora is not None else {}))
        before_destroy(engine.shutdown)  # vLLM's shutdown needs the process group it shares
        return engine
    if rollout.engine == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(model, stop_ids, tokenizer.pad_token_id, env.device,
                           process_group=shard_group, max_batch=rollout.max_num_seqs,
                           reshard_after_forward=reshard_after_forward, record_routes=record_routes)
    raise ValueError(f"unknown rollout engine {rollout.engine!r}")


def world_group(env: DistEnv) -> dist.ProcessGroup | None:
    """The group an FSDP2-sharded policy's forwards gather over (None on one rank)."""
    return dist.group.WORLD if env.world_size > 1 else None


def cpu_env() -> DistEnv:
    """A one-process CPU environment, for engines built outside a launch (the ablation's base statistics)."""
    return DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), mesh=None)


__all__ = ["build_engine", "cpu_env", "world_group"]

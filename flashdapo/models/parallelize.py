"""FSDP2 over every rank: the policy's decoder blocks, then its root, with activation checkpointing by config.
One short function, as torchtitan's `parallelize` is: the layout is decided here and nowhere else."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from ..config import ModelConfig, TrainerConfig
from ..distributed.mesh import DistEnv
from .moe.expert_parallel import parallelize_experts
from .moe.router import check_router_aux_coef
from .policy import PolicyModel


def parallelize(policy: PolicyModel, env: DistEnv, model_cfg: ModelConfig,
                trainer_cfg: TrainerConfig) -> PolicyModel:
    """The micro-batch layout (packed or padded, sequence-parallel shards), activation checkpointing (by
    config), then FSDP2 `fully_shard` on every decoder block, then the root, over every rank.

    bf16 compute with fp32 master weights and fp32 gradient reduction when model.dtype is bfloat16 (GPU);
    plain fp32 otherwise (CPU). Gradients are SUMMED over ranks, not averaged: the loss is already
    divided by the global token count of the mini-batch.
    """
    check_router_aux_coef(model_cfg.router_aux_loss_coef, policy.config)
    policy.set_layout(trainer_cfg.pack_sequences or model_cfg.attn_implementation == "flash_attention_2", env)
    policy.micro_batch_tokens = trainer_cfg.micro_batch_tokens
    layers = policy.decoder_layers()
    if model_cfg.gradient_checkpointing:
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    param_dtype = torch.bfloat16 if model_cfg.dtype == "bfloat16" else None
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    offload = CPUOffloadPolicy() if trainer_cfg.fsdp_cpu_offload else OffloadPolicy()
    # MoE experts first, over the ranks holding the same experts (moe/expert_parallel.py); the blocks skip
    # them.
    parallelize_experts(policy.hf, env, trainer_cfg.expert_parallel, mp_policy=mp, offload_policy=offload,
                        reshard_after_forward=trainer_cfg.reshard_after_forward)
    for layer in layers:
        fully_shard(layer, mesh=env.mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=trainer_cfg.reshard_after_forward)
    fully_shard(policy, mesh=env.mesh, mp_policy=mp, offload_policy=offload)
    for module in policy.modules():  # the setting is per FSDP unit, not recursive
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return policy


__all__ = ["parallelize"]

"""Loading an HF checkpoint into the sharded policy without a full copy on every rank.

Rank 0 reads the checkpoint (fp32 master weights) on the CPU; the other ranks build the same
architecture on the meta device (no memory). All ranks apply FSDP2, the meta ranks allocate their
shards, and rank 0's full state dict is broadcast into every rank's shards
(`set_model_state_dict(..., broadcast_from_rank0=True)`). Buffers that are not in the state dict
(rotary `inv_freq`) are broadcast from rank 0 as well. Host memory: one fp32 copy on rank 0 instead of
one per rank. A quantized checkpoint (fp8 block-wise, mxfp4) is dequantized on rank 0 into the plain model
(quantized.py); every rank builds the model from its config without the quantization_config.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

from ..config import Config
from ..distributed.mesh import DistEnv
from .adapter_dir import merge_adapter
from .hf import resolved_attention
from .invariant import make_batch_invariant
from .lora import add_adapters
from .parallelize import parallelize
from .policy import PolicyModel
from .quantized import load_pretrained, plain_config


def load_sharded_policy(cfg: Config, env: DistEnv, log=None, purpose: str = "training",
                        adapter: str = "") -> PolicyModel:
    """The policy of `cfg.model.path`, FSDP2-sharded over `env`, fp32 master weights; `log` gets the line of a
    dequantized checkpoint (rank 0), saying what it is loaded for (`purpose`: training, sampling). `adapter`:
    a PEFT adapter directory over that base, merged in on rank 0 before the broadcast (adapter_dir.py)."""
    mc = cfg.model
    config = plain_config(AutoConfig.from_pretrained(mc.path))
    attention = resolved_attention(mc.attn_implementation, config)
    # LoRA: the frozen base stays in the compute dtype (no fp32 master copy); the adapters are fp32.
    dtype = torch.bfloat16 if cfg.lora.enabled and mc.dtype == "bfloat16" else torch.float32
    if env.rank == 0:  # the side's rank 0 (split placement's rollout side reads its own copy)
        hf = load_pretrained(mc.path, dtype, attention, log, purpose=purpose)
        if adapter:
            hf = merge_adapter(hf, adapter)
    else:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    if cfg.lora.enabled:
        add_adapters(hf, cfg.lora, cfg.trainer.seed)  # rank 0's draw reaches the others with the weights
    full = {k: v for k, v in hf.state_dict().items()} if env.rank == 0 else {}
    policy = PolicyModel(hf, attention, cfg.trainer.kernel_impl, cfg.rollout.temperature)
    if cfg.trainer.batch_invariant:
        make_batch_invariant(policy, torch.bfloat16 if mc.dtype == "bfloat16" else torch.float32, env.device,
                             cfg.rollout.engine)
    policy = parallelize(policy, env, mc, cfg.trainer)
    if env.world_size == 1:
        return policy
    if env.rank != 0:
        policy.to_empty(device=env.device if not cfg.trainer.fsdp_cpu_offload else torch.device("cpu"))
    set_model_state_dict(policy.hf, full, options=StateDictOptions(full_state_dict=True,
                                                                   broadcast_from_rank0=True))
    for buffer in policy.buffers():  # non-persistent buffers are not in the state dict
        work = buffer if env.device.type == buffer.device.type else buffer.to(env.device)
        dist.broadcast(work, src=0)
        if work is not buffer:
            buffer.copy_(work)
    return policy

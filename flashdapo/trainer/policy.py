"""The policy: an HF causal LM run to its final hidden states, with log-probs and the DAPO loss taken
through `flashdapo.kernels` from the LM-head weight (never through the model's `[tokens, vocab]` logits).

`PolicyModel` is the FSDP2 root. All training computation happens inside its `forward`, so FSDP2's
hooks gather the root-level parameters (embeddings, final norm, LM head) around it and reduce their
gradients after backward. Called with HF keyword arguments instead (`input_ids=..., past_key_values=...`)
it is the plain HF model, which is how the rollout engine samples from it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from ..config import ModelConfig, TrainerConfig
from ..kernels import LossStats, dapo_loss, token_logprobs
from .distributed import DistEnv


@dataclass
class PackedBatch:
    """One micro-batch: sequences (prompt + response) packed into a single row without padding."""

    input_ids: torch.Tensor
    """[1, T] token ids of all sequences back to back."""
    position_ids: torch.Tensor
    """[1, T] positions restarting at 0 for every sequence."""
    segment_ids: torch.Tensor
    """[T] index of the sequence each token belongs to (attention stays inside a sequence)."""
    predict_index: torch.Tensor
    """[N] positions whose hidden state predicts a response token."""
    targets: torch.Tensor
    """[N] the response tokens predicted at `predict_index`."""
    token_counts: list[int]
    """Response tokens of each sequence, in order (to split per-token outputs back)."""


@dataclass
class LossInputs:
    """Per response token of a PackedBatch: what the DAPO loss needs besides the log-probs."""

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    normalizer: torch.Tensor
    clip_low: float
    clip_high: float
    clip_ratio_c: float | None


def pack_sequences(prompts: list[torch.Tensor], responses: list[torch.Tensor], device: torch.device) -> PackedBatch:
    """Pack (prompt, response) pairs into one row; the last response token is never an input."""
    ids, positions, segments, predict, targets, counts = [], [], [], [], [], []
    offset = 0
    for seq, (prompt, response) in enumerate(zip(prompts, responses)):
        tokens = torch.cat([prompt, response[:-1]]) if len(response) else prompt
        ids.append(tokens)
        positions.append(torch.arange(len(tokens)))
        segments.append(torch.full((len(tokens),), seq))
        # Hidden state at position p predicts token p + 1: response token j sits at len(prompt) + j.
        predict.append(offset + len(prompt) - 1 + torch.arange(len(response)))
        targets.append(response)
        counts.append(len(response))
        offset += len(tokens)
    return PackedBatch(
        input_ids=torch.cat(ids).long().unsqueeze(0).to(device),
        position_ids=torch.cat(positions).unsqueeze(0).to(device),
        segment_ids=torch.cat(segments).to(device),
        predict_index=torch.cat(predict).long().to(device),
        targets=torch.cat(targets).long().to(device),
        token_counts=counts,
    )


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] bool mask: causal, and no attention across packed sequences (exact per sequence)."""
    same = segment_ids[:, None] == segment_ids[None, :]
    causal = torch.ones_like(same).tril()
    return (same & causal)[None, None]


class PolicyModel(nn.Module):
    """The HF causal LM plus the fused log-prob / loss head. The FSDP2 root."""

    def __init__(self, hf_model: nn.Module, attn_implementation: str, kernel_impl: str, temperature: float):
        super().__init__()
        self.hf = hf_model
        self.attn_implementation = attn_implementation
        self.kernel_impl = kernel_impl
        self.temperature = temperature
        # transformers >= 5 calls the KV-cache argument `cache`; 4.x `past_key_values`.
        params = inspect.signature(type(hf_model).forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def config(self):
        return self.hf.config

    def decoder_layers(self) -> nn.ModuleList:
        return self.hf.model.layers

    def lm_head_weight(self) -> torch.Tensor:
        return self.hf.get_output_embeddings().weight

    def forward(self, batch: PackedBatch | None = None, loss_inputs: LossInputs | None = None,
                with_entropy: bool = False, cache=None, **hf_kwargs):
        """Training: per-token (logp, entropy) of `batch`, or (loss, LossStats) given `loss_inputs`.
        Sampling: with HF keyword arguments and no batch, the HF model's own forward (`cache` is the KV
        cache, passed under the name this transformers version uses)."""
        if batch is None:
            if cache is not None:
                hf_kwargs[self._cache_arg] = cache
            return self.hf(**hf_kwargs)
        hidden = self._hidden_states(batch)
        weight = self.lm_head_weight()
        if loss_inputs is None:
            return token_logprobs(hidden, weight, batch.targets, temperature=self.temperature,
                                  with_entropy=True, impl=self.kernel_impl) if with_entropy else (
                token_logprobs(hidden, weight, batch.targets, temperature=self.temperature,
                               impl=self.kernel_impl), None)
        li = loss_inputs
        return dapo_loss(hidden, weight, batch.targets, li.old_logprobs, li.advantages, li.mask,
                         clip_low=li.clip_low, clip_high=li.clip_high, clip_ratio_c=li.clip_ratio_c,
                         temperature=self.temperature, normalizer=li.normalizer, impl=self.kernel_impl)

    def _hidden_states(self, batch: PackedBatch) -> torch.Tensor:
        if self.attn_implementation == "flash_attention_2":
            # flash-attn reads sequence boundaries from the restarting position ids (varlen).
            mask = None
        else:
            mask = block_causal_mask(batch.segment_ids)
        out = self.hf.model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask,
                            use_cache=False)
        return out.last_hidden_state[0].index_select(0, batch.predict_index)


def parallelize(policy: PolicyModel, env: DistEnv, model_cfg: ModelConfig, trainer_cfg: TrainerConfig) -> PolicyModel:
    """Activation checkpointing (by config), then FSDP2 `fully_shard` on every decoder block, then the root.

    bf16 compute with fp32 master weights and fp32 gradient reduction when model.dtype is bfloat16 (GPU);
    plain fp32 otherwise (CPU). Gradients are SUMMED over ranks, not averaged: the loss is already
    divided by the global token count of the mini-batch.
    """
    layers = policy.decoder_layers()
    if model_cfg.gradient_checkpointing:
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    param_dtype = torch.bfloat16 if model_cfg.dtype == "bfloat16" else None
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    offload = CPUOffloadPolicy() if trainer_cfg.fsdp_cpu_offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mesh=env.mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=trainer_cfg.reshard_after_forward)
    fully_shard(policy, mesh=env.mesh, mp_policy=mp, offload_policy=offload)
    for module in policy.modules():  # the setting is per FSDP unit, not recursive
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return policy


def per_token_split(values: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """Split a per-response-token vector of `batch` back into one tensor per sequence."""
    return list(torch.split(values, batch.token_counts))


__all__ = ["LossInputs", "LossStats", "PackedBatch", "PolicyModel", "block_causal_mask", "pack_sequences",
           "parallelize", "per_token_split"]

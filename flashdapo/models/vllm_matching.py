"""trainer.batch_invariant with rollout.engine vllm: the policy's decoder computed as vLLM's batch-invariant
forward computes it, so that a token's hidden state is the engine's bits (docs/algorithm.md). **Written for
CUDA against vLLM 0.32; not yet run on a GPU** (tests/rollout/test_exact_on_policy_vllm.py settles it).

transformers' Llama-style decoder (Qwen2, Qwen3, Llama) and vLLM's differ in how they group the same
arithmetic: vLLM multiplies q/k/v and gate/up as merged weights, fuses the residual add into the next norm,
applies SiLU and the product in one kernel. Class swaps on this policy's modules (no process-wide patch; the
parameters and their state-dict names stay, so FSDP2, checkpoints and weight pushes are untouched) make the HF
modules call models/vllm_matching_ops.py's operations in vLLM's grouping:

- `MatchingAttention`: q/k/v as one GEMM over the concatenated weights (and biases), q_norm/k_norm (Qwen3)
  per head, vLLM's rotary on the packed row's positions, flash-attention per document, o_proj.
- `MatchingMLP`: gate/up as one GEMM, SiLU-and-multiply, down_proj.
- `MatchingRMSNorm`: vLLM's norm kernel; `residual_kernel` where vLLM calls its norm with a residual
  (every decoder norm but the first layer's input norm, and the final norm).

The LM head is flashdapo's own kernel on both sides (`token_logprobs(..., invariant=True)`; the engine's
sampled log-prob is replaced by it, rollout/vllm_invariant.py). The forward runs on packed rows only
(models/packing.py's document bounds: the old-log-prob pass and the update); a padded call is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from . import vllm_matching_ops as ops_
from .hf import decoder_layers
from .vllm_matching_ops import MatchingOps

MATCHED_FAMILIES = ("llama", "qwen2", "qwen3")
"""The model types whose decoder this module lays out as vLLM does."""


class MatchingRMSNorm(nn.Module):
    """An HF RMSNorm (weight, variance_epsilon) computed by the matching ops' norm."""

    matching_ops: MatchingOps
    residual_kernel: bool

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        out = ops_.rms_norm(self.matching_ops, hidden_states.reshape(-1, shape[-1]), self.weight,
                            self.variance_epsilon, self.residual_kernel)
        return out.reshape(shape)


class MatchingMLP(nn.Module):
    """An HF gated MLP (gate_proj, up_proj, down_proj, SiLU) in vLLM's grouping."""

    matching_ops: MatchingOps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.matching_ops
        rows = x.reshape(-1, x.shape[-1])
        gate_up = ops_.linear(ops, rows, torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        out = ops_.linear(ops, ops_.silu_and_mul(ops, gate_up), self.down_proj.weight)
        return out.reshape(*x.shape[:-1], -1)


class MatchingAttention(nn.Module):
    """An HF Llama-style attention (q/k/v/o_proj, optional q_norm/k_norm) in vLLM's grouping, on a packed
    row."""

    matching_ops: MatchingOps

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, position_ids: torch.Tensor | None = None, **kwargs):
        bounds = kwargs.get("flashdapo_bounds")
        packed = bounds is not None and position_ids is not None and hidden_states.shape[0] == 1
        if not packed or past_key_values is not None:
            raise ConfigError("trainer.batch_invariant with rollout.engine vllm: the policy's vLLM-matching "
                              "forward runs on packed rows only (trainer.pack_sequences true)")
        ops, d = self.matching_ops, self.head_dim
        rows = hidden_states[0]
        weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        biases = [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]
        bias = torch.cat(biases) if biases[0] is not None else None
        qkv = ops_.linear(ops, rows, torch.cat(weights), bias)
        q, k, v = qkv.split([w.shape[0] for w in weights], dim=-1)
        if getattr(self, "q_norm", None) is not None:  # Qwen3: per head, before the rotation
            q = self.q_norm(q.reshape(-1, d)).reshape(q.shape)
            k = self.k_norm(k.reshape(-1, d)).reshape(k.shape)
        q, k = ops_.rotary(ops, position_ids[0], q, k, d)
        out = ops_.attention(ops, q.reshape(len(rows), -1, d), k.reshape(len(rows), -1, d),
                             v.reshape(len(rows), -1, d), bounds, self.scaling)
        return ops_.linear(ops, out.reshape(len(rows), -1), self.o_proj.weight, self.o_proj.bias)[None], None


def vllm_matching_refusal(hf: nn.Module) -> str | None:
    """Why `hf`'s decoder cannot be laid out as vLLM's batch-invariant forward here (one line); None: it
    can."""
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    if config.model_type not in MATCHED_FAMILIES:
        return f"model type {config.model_type} (matched: {', '.join(MATCHED_FAMILIES)})"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention layers"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act} (matched: silu)"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if any(hasattr(m, "base_layer") for layer in decoder_layers(hf) for m in layer.modules()):
        return "LoRA adapters (vLLM's LoRA kernels are not matched)"
    return None


def make_vllm_matching(hf: nn.Module, ops: MatchingOps) -> None:
    """Lay `hf`'s decoder out as vLLM's batch-invariant forward, computing with `ops` (module docstring);
    in place, before FSDP2. ConfigError, one line, for a family it does not match."""
    refusal = vllm_matching_refusal(hf)
    if refusal is not None:
        raise ConfigError(f"trainer.batch_invariant with rollout.engine vllm: {refusal} is not laid out as "
                          "vLLM's batch-invariant forward; use rollout.engine torch")
    for index, layer in enumerate(decoder_layers(hf)):
        _swap(layer.self_attn, MatchingAttention, ops)
        _swap(layer.mlp, MatchingMLP, ops)
        for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
            if norm is not None:
                _swap(norm, MatchingRMSNorm, ops, residual_kernel=False)
        # vLLM's first layer norms its input alone; every later norm gets (x, residual) and fuses the add.
        _swap(layer.input_layernorm, MatchingRMSNorm, ops, residual_kernel=index > 0)
        _swap(layer.post_attention_layernorm, MatchingRMSNorm, ops, residual_kernel=True)
    _swap(hf.model.norm, MatchingRMSNorm, ops, residual_kernel=True)


def _swap(module: nn.Module, cls: type, ops: MatchingOps, **attributes) -> None:
    """Give `module` the matching forward of `cls` (a subclass made once per original class)."""
    module.__class__ = _matching_class(type(module), cls)
    module.matching_ops = ops
    for name, value in attributes.items():
        setattr(module, name, value)
    if cls is MatchingRMSNorm and not hasattr(module, "variance_epsilon"):
        module.variance_epsilon = module.eps


_CLASSES: dict[tuple[type, type], type] = {}


def _matching_class(original: type, matching: type) -> type:
    if issubclass(original, matching):
        return original
    key = (original, matching)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{matching.__name__}_{original.__name__}", (matching, original), {})
    return _CLASSES[key]


__all__ = ["MATCHED_FAMILIES", "MatchingAttention", "MatchingMLP", "MatchingRMSNorm", "make_vllm_matching",
           "vllm_matching_refusal"]

"""trainer.batch_invariant: the policy's forward made batch-invariant, for the trainer and the torch engine.

A token's log-prob then comes out the same bits in the engine's decode step (a few rows over a KV cache), in
the trainer's old-log-prob pass (packed or padded rows of thousands of tokens) and in the update's fused
sweep, so `algorithm.old_logprobs=rollout` is exact (docs/algorithm.md). What changes, on this policy only (no
process-wide patch):

- every `nn.Linear` of the decoder (a LoRA adapter's too) computes through `kernels.invariant_linear`
  (`InvariantLinear`: the same module, parameters and state-dict names, another forward);
- attention is `flashdapo_invariant` (kernels.invariant_attention, key blocks anchored at each query's first
  key), registered with transformers' attention interface and its mask builder, and used by the packed path
  for each document (models/packing.py);
- the LM head runs the kernels with `invariant=True` (policy.py), and the torch engine takes its sampled
  token's log-prob from the same kernel on the decode step's hidden state (rollout/torch_engine.py).

Elementwise operations and the norms' reductions along the hidden dimension are already batch-invariant on
the CPUs this runs on (tests/rollout/test_exact_on_policy.py checks the whole forward). Families whose layers
need more are refused in one line (`batch_invariant_refusal`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..config import ConfigError
from ..kernels.invariant import (
    attention_extents,
    gemm_is_row_invariant,
    invariant_attention,
    invariant_linear,
)
from .hf import decoder_layers
from .moe import routers
from .packing import INVARIANT_INNER, attention_logit_softcap, has_attention_sinks
from .vllm_matching import make_vllm_matching
from .vllm_matching_ops import vllm_ops

INVARIANT_ATTENTION = INVARIANT_INNER
"""The attention implementation's name in transformers' registry (the packed path's inner one too)."""


class InvariantLinear(nn.Linear):
    """An nn.Linear whose rows are computed in whole GEMM tiles (kernels.invariant_linear)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's own name
        return invariant_linear(input, self.weight, self.bias)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               sliding_window: int | None = None, softcap: float | None = None, s_aux=None, **_):
    """transformers' attention signature: query [B, H, Tq, D], key/value [B, Hkv, Tk, D], a boolean mask
    [B, 1, Tq, Tk] (True: attend) or None (causal) -> ([B, Tq, H, D], None)."""
    if sliding_window or softcap or s_aux is not None:
        raise ConfigError("trainer.batch_invariant: sliding windows, attention softcaps and sinks are not "
                          "covered by the batch-invariant attention")
    tq, tk = query.shape[2], key.shape[2]
    if attention_mask is not None and _EXTENTS and _EXTENTS[0] is attention_mask:
        first, count = _EXTENTS[1:]  # every layer of a forward gets the same mask object
    else:
        if attention_mask is None:
            allowed = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
        else:
            mask = attention_mask[:, 0]
            allowed = mask if mask.dtype == torch.bool else mask == 0
        first, count = attention_extents(allowed.expand(query.shape[0], tq, tk))
        _EXTENTS[:] = [attention_mask, first, count] if attention_mask is not None else []
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return invariant_attention(query, key, value, first, count, scale), None


_EXTENTS: list = []
"""The last mask's (mask, first, count): the layers of one forward share the mask, so the anchors are found
once a forward (a mask is never written to once built)."""


def _boolean_mask(*args, **kwargs):
    """transformers' SDPA mask, always materialized (a boolean [B, 1, Tq, Tk]): the anchors come from it."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


@functools.cache
def register_invariant_attention() -> str:
    """Register (once) the batch-invariant attention and its mask builder with transformers; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(INVARIANT_ATTENTION, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(INVARIANT_ATTENTION, _boolean_mask)
    return INVARIANT_ATTENTION


def batch_invariant_refusal(hf: nn.Module) -> str | None:
    """Why `hf`'s forward cannot be made batch-invariant here (one line), None where it can."""
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    layer_types = set(getattr(config, "layer_types", None) or ())
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types \
            or getattr(config, "sliding_window_pattern", None):
        return "sliding-window attention layers"
    if layer_types - {"full_attention", "sliding_attention"}:
        return f"{', '.join(sorted(layer_types - {'full_attention', 'sliding_attention'}))} layers"
    if attention_logit_softcap(hf.config):
        return "attention-logit softcapping"
    if has_attention_sinks(hf):
        return "attention sinks"
    if routers(hf):
        return "mixture-of-experts layers (the routed experts' grouped GEMMs)"
    return None


def make_batch_invariant(policy: nn.Module, dtype: torch.dtype | None = None,
                         device: torch.device | str | None = None, engine: str = "torch") -> None:
    """Make `policy` (a PolicyModel, before FSDP2 and before its layout is set) batch-invariant in place
    (module docstring); with `engine` "vllm", its decoder computes as vLLM's batch-invariant forward does
    (models/vllm_matching.py, CUDA). ConfigError, one line, for a family it cannot cover, or a machine whose
    GEMMs in the compute `dtype` on `device` (default: the parameters') are not row-invariant even over whole
    tiles (the LM head's)."""
    hf = policy.hf
    refusal = batch_invariant_refusal(hf)
    if refusal is not None:
        raise ConfigError(f"trainer.batch_invariant: {hf.config.model_type}'s {refusal} are not covered by "
                          "the batch-invariant forward; set trainer.batch_invariant false")
    dtype = dtype or next(hf.parameters()).dtype
    device = device or next(hf.parameters()).device
    if not gemm_is_row_invariant(dtype, device):
        raise ConfigError(f"trainer.batch_invariant: this machine's {dtype} GEMMs give a row other bits in a "
                          "one-tile call than among many (kernels/invariant.py); set trainer.batch_invariant "
                          "false")
    if engine == "vllm":
        make_vllm_matching(hf, vllm_ops(hf, torch.device(device)))
        policy.invariant = True
        return
    for layer in decoder_layers(hf):
        for module in layer.modules():
            if type(module) is nn.Linear:
                module.__class__ = InvariantLinear
    hf.config._attn_implementation = register_invariant_attention()
    policy.invariant = True


__all__ = ["INVARIANT_ATTENTION", "InvariantLinear", "batch_invariant_refusal", "make_batch_invariant",
           "register_invariant_attention"]

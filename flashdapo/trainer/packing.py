"""Padding-free micro-batches on any device: one packed row of responses, attention per response.

A packed row [1, T] concatenates the (prompt + response) sequences of a micro-batch; `cu_seqlens` [D + 1]
are their boundaries. Attention must not cross them. With flash-attn (model.attn_implementation =
flash_attention_2) the varlen kernel reads the boundaries; with SDPA or eager attention, torch's own
`scaled_dot_product_attention` runs causally on each document's slice, so the attention work is
sum_d L_d^2 (no padding, no [T, T] block mask) on every device torch runs on. flex_attention with a
document mask would need torch.compile to be fast on CPU and materializes [T, T] scores without it.
flash-attn's varlen kernel is called directly (flash_attn_varlen_func), on the same boundaries.

The policy's HF model is switched to an attention implementation of its own, `flashdapo_packed_<inner>`:
called with the packed keyword arguments (`cu_seq_lens_q`, from `packed_attention_kwargs`) it attends per
document, optionally inside the Ulysses all-to-alls (`ulysses.py`); called without them (the rollout engine
sampling with a KV cache, a padded micro-batch) it is exactly the inner implementation, whose mask builder
it shares. The layer looks the function up on every call, so the activation-checkpoint recompute in
backward takes the same path as the forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .ulysses import heads_to_sequence, sequence_to_heads

PREFIX = "flashdapo_packed_"


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                       scaling: float | None) -> torch.Tensor:
    """Causal attention within each document of a packed row, by SDPA per document.

    query [1, H, T, D], key/value [1, Hkv, T, D] (H a multiple of Hkv: grouped-query attention), cu_seqlens
    [D + 1] (host ints). Returns [1, T, H, D], the layout HF attention functions return.
    """
    bounds = cu_seqlens.tolist()
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # SDPA's enable_gqa is not taken by every backend: repeat the KV heads once
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                            scale=scaling)
             for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, *, inner: str, scaling: float | None = None, dropout: float = 0.0,
                      cu_seq_lens_q: torch.Tensor | None = None, flashdapo_sp_group=None, **kwargs):
    """The registered attention function (HF's signature); `inner` is the implementation it stands in for."""
    if cu_seq_lens_q is None:  # not a packed training forward: the inner implementation as HF runs it
        return _as_inner(module, inner, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if flashdapo_sp_group is not None:  # sequence shards -> head shards of the whole row
        query, key, value = (sequence_to_heads(t, flashdapo_sp_group) for t in (query, key, value))
    if inner == "flash_attention_2":
        out = flash_document_attention(query, key, value, cu_seq_lens_q, scaling)
    else:
        out = document_attention(query, key, value, cu_seq_lens_q, scaling)
    if flashdapo_sp_group is not None:  # head shards -> this rank's sequence shard, all heads
        out = heads_to_sequence(out, flashdapo_sp_group)
    return out, None


def flash_document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                             scaling: float | None) -> torch.Tensor:
    """`document_attention` by flash-attn's varlen kernel (GPU; grouped-query heads natively). [1, T, H, D]."""
    from flash_attn import flash_attn_varlen_func

    bounds = cu_seqlens.to(query.device, torch.int32)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    out = flash_attn_varlen_func(q, k, v, bounds, bounds, longest, longest, causal=True, softmax_scale=scaling)
    return out.unsqueeze(0)


def _as_inner(module: nn.Module, inner: str, *args, **kwargs):
    """Call the inner implementation with the config naming it for the call (HF's flash-attn path reads the
    name from there to pick its kernels)."""
    config = module.config
    name, config._attn_implementation = config._attn_implementation, inner
    try:
        return ALL_ATTENTION_FUNCTIONS[inner](module, *args, **kwargs)
    finally:
        config._attn_implementation = name


@functools.cache
def packed_implementation(inner: str) -> str:
    """Register (once) and name the packed attention implementation standing in for `inner`."""
    name = PREFIX + inner
    AttentionInterface.register(name, functools.partial(_packed_attention, inner=inner))
    if inner in ALL_MASK_ATTENTION_FUNCTIONS:  # unpacked calls build the mask the inner one would
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


def use_packed_attention(hf_model: nn.Module) -> None:
    """Switch `hf_model` to the packed stand-in of its attention implementation (idempotent)."""
    config = hf_model.config
    inner = config._attn_implementation
    if not inner.startswith(PREFIX):
        config._attn_implementation = packed_implementation(inner)


def packed_attention_kwargs(hf_model: nn.Module, cu_seqlens: torch.Tensor, sp_group=None) -> dict:
    """Keyword arguments of the HF model's forward for a packed row: the document boundaries (which the
    layers pass to the attention function), the sequence-parallel group, and a prepared (empty) mask per
    layer type so that the model builds no [T, T] mask."""
    layer_types = getattr(hf_model.config, "layer_types", None)
    # Models with per-layer-type masks (Qwen2, Qwen3) take a prepared mapping and build nothing; the others
    # (Llama, Mistral) take None, for which the mask builder of a causal batch without padding returns
    # None too (SDPA's is_causal path); the packed attention reads only cu_seq_lens either way.
    mask = {t: None for t in set(layer_types)} if layer_types else None
    return {"attention_mask": mask, "cu_seq_lens_q": cu_seqlens, "flashdapo_sp_group": sp_group}


__all__ = ["document_attention", "packed_attention_kwargs", "packed_implementation", "use_packed_attention"]

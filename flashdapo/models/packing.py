"""Padding-free micro-batches on any device: one packed row of responses, attention per response.

A packed row [1, T] concatenates the (prompt + response) sequences of a micro-batch; `DocumentBounds` are
their boundaries, made once per micro-batch in the two forms attention reads: host ints (SDPA slices by
them) and int32 offsets on the device with the longest length as a host int (flash-attn's `cu_seqlens`
and `max_seqlen`), so no layer copies boundaries to the GPU or syncs with it. Attention must not cross
them. With flash-attn (model.attn_implementation = flash_attention_2) the varlen kernel
(flash_attn_varlen_func) reads the boundaries; with SDPA or eager attention, torch's own
`scaled_dot_product_attention` runs causally on each document's slice, so the attention work is
sum_d L_d^2 (no padding, no [T, T] block mask) on every device torch runs on. flex_attention with a
document mask would need torch.compile to be fast on CPU and materializes [T, T] scores without it.

Sliding-window layers (HF passes `sliding_window` = W to the attention function: Qwen2's layers past
max_window_layers when use_sliding_window is set, Mistral's) keep HF's window: key j is visible to query
i iff i - W < j <= i (transformers' sliding_window_overlay and causal mask). flash-attn reads it as
window_size=(W - 1, 0) (its query i sees keys [i - left, i + right]; HF's own flash path passes
(W - 1, W - 1), the same under causal=True); SDPA runs a document longer than W in query blocks of W,
each against the keys it can see, with a banded mask of at most [W, 2W - 1].

Attention-logit softcapping (Gemma 2/3: HF passes `softcap` = c) and attention sinks (GPT-OSS: HF passes
`s_aux`, one learned logit per head that joins each row's softmax denominator and contributes no value) are
honoured: SDPA can take neither, so a document is then attended with explicit scores, c * tanh(s / c) before
the mask and softmax, the sink appended as one more column and dropped after the softmax (as transformers'
eager functions of those models compute), in query blocks of at most `QUERY_BLOCK` rows against the keys the
block can see (never [T, T] over the packed row, never [L, L] for a long document). flash-attn's varlen kernel
takes `softcap`; it takes no sinks, so `use_packed_attention` refuses flash-attn for a model with sinks at
start-up, in one line.

The policy's HF model is switched to an attention implementation of its own, `flashdapo_packed_<inner>`:
called with the packed keyword arguments (from `packed_attention_kwargs`) it attends per document,
optionally inside the Ulysses all-to-alls (`ulysses.py`); called without them (the rollout engine
sampling with a KV cache, a padded micro-batch) it is exactly the inner implementation, whose mask builder
it shares; for eager attention, which transformers does not register (each modeling file has its own
`eager_attention_forward`, Gemma 2's with the softcap, GPT-OSS's with the sinks), that of the module's own
modeling file. Packed rows get a prepared mask (empty) so that the model builds none. The layer looks the
function up on every call, so the activation-checkpoint recompute in backward takes the same path as the
forward.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import ConfigError
from ..kernels.invariant import invariant_attention
from .attention_limits import check_flash_attention
from .linear_attention import use_document_linear_attention
from .ulysses import expand_kv_heads, heads_to_sequence, local_heads, sequence_to_heads

PREFIX = "flashdapo_packed_"
QUERY_BLOCK = 256
"""Query rows of one block of explicit scores (softcap, sinks): a block's scores are [H, 256, keys it
sees]."""


@dataclass(frozen=True)
class DocumentBounds:
    """The documents of a packed row, made once per micro-batch in the forms attention reads."""

    offsets: tuple[int, ...]
    """[D + 1] cumulative document lengths, host ints (SDPA slices by them)."""
    cu_seqlens: torch.Tensor
    """The same offsets, int32 on the model's device (flash-attn's cu_seqlens_q/k)."""
    longest: int
    """The longest document (flash-attn's max_seqlen_q/k)."""

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str) -> DocumentBounds:
        """Bounds of documents of `lengths` tokens, in order; the device copy is the one copy made."""
        offsets = tuple(itertools.accumulate(lengths, initial=0))
        return cls(offsets, torch.tensor(offsets, dtype=torch.int32).to(device), max(lengths))


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offsets: Sequence[int],
                       scaling: float | None, window: int | None = None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within each document of a packed row, by SDPA per document (by explicit scores per
    document when there is a softcap or sinks, which SDPA cannot take).

    query [1, H, T, D], key/value [1, Hkv, T, D] (H a multiple of Hkv: grouped-query attention), offsets
    [D + 1] host ints, window: HF's sliding window (None: full causal), softcap: c in c * tanh(scores / c)
    (None: none), sinks: [H] one logit per query head joining each softmax's denominator (None: none).
    Returns [1, T, H, D], the layout HF attention functions return.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # SDPA's enable_gqa is not taken by every backend: repeat the KV heads once
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    if softcap is None and sinks is None:
        parts = [_causal(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scaling, window)
                 for a, b in zip(offsets[:-1], offsets[1:]) if b > a]
    else:
        parts = [
            _explicit(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scaling, window, softcap, sinks)
            for a, b in zip(offsets[:-1], offsets[1:]) if b > a
        ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
            window: int | None) -> torch.Tensor:
    """One document's causal attention, [1, H, L, D]; with a window W shorter than the document, key j is
    visible to query i iff i - W < j <= i, computed in query blocks of W against keys [start - W + 1, end)
    (a [W, 2W - 1] mask, never [L, L])."""
    length = query.shape[2]
    if window is None or length <= window:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    blocks = []
    for start in range(0, length, window):
        end, first = min(start + window, length), max(0, start - window + 1)
        blocks.append(
            F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, first:end],
                                           value[:, :, first:end], scale=scaling,
                                           attn_mask=_visible(start, end, first, window, query.device)))
    return torch.cat(blocks, dim=2)


def _explicit(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
              window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One document's causal attention with explicit scores, [1, H, L, D], as transformers' eager functions
    compute it: scores * scaling, capped to c * tanh(scores / c) (Gemma 2/3), masked (causal, HF's window),
    the sink logit appended as a column and dropped after the softmax (GPT-OSS). The softmax runs in at least
    fp32. Query blocks of `QUERY_BLOCK` rows, each against the keys it can see ([first, end)), so a block's
    scores are [H, QUERY_BLOCK, end - first], never [L, L]. With gradients each block is checkpointed:
    backward recomputes its scores instead of keeping every block's (H x L^2 / 2 floats per document, as eager
    would)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (query, key, value, sinks))
    blocks = []
    for start in range(0, query.shape[2], QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, query.shape[2])
        first = 0 if window is None else max(0, start - window + 1)
        args = (query[:, :, start:end], key[:, :, first:end], value[:, :, first:end], sinks,
                _visible(start, end, first, window, query.device), scale, softcap)
        blocks.append(checkpoint(_scored_block, *args, use_reentrant=False) if grad else _scored_block(*args))
    return torch.cat(blocks, dim=2)


def _scored_block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor | None,
                  visible: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """softmax(cap(query key^T * scale) masked to `visible` [, sinks]) value for one block of queries."""
    compute = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query, key.transpose(2, 3)).to(compute) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink joins the denominator and carries no value: its column is dropped
        batch, heads, rows, _ = scores.shape
        sink = sinks.to(compute).reshape(1, heads, 1, 1).expand(batch, heads, rows, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(value.dtype), value)


def _visible(start: int, end: int, first: int, window: int | None, device) -> torch.Tensor:
    """[end - start, end - first] bool: key j visible to query i (document positions), j <= i, and
    i - W < j under HF's sliding window W."""
    i = torch.arange(start, end, device=device)[:, None]
    j = torch.arange(first, end, device=device)[None, :]
    return (j <= i) if window is None else (j <= i) & (j > i - window)


def flash_document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             bounds: DocumentBounds, scaling: float | None, window: int | None = None,
                             softcap: float | None = None) -> torch.Tensor:
    """`document_attention` by flash-attn's varlen kernel (GPU; grouped-query heads natively). [1, T, H, D].

    The boundaries are already int32 on the device and the longest length a host int (`DocumentBounds`):
    nothing here copies to the GPU or waits for it. A softcap goes to the kernel's own `softcap`."""
    from flash_attn import flash_attn_varlen_func

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D], last dim contiguous
    # window_size=(left, right): query i sees keys [i - left, i + right]; causal caps right at 0.
    extra = {} if window is None else {"window_size": (window - 1, 0)}
    if softcap is not None:
        extra["softcap"] = softcap
    out = flash_attn_varlen_func(q, k, v, bounds.cu_seqlens, bounds.cu_seqlens, bounds.longest,
                                 bounds.longest, causal=True, softmax_scale=scaling, **extra)
    return out.unsqueeze(0)


def _packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, *, inner: str, flashdapo_bounds: DocumentBounds | None = None,
                      flashdapo_sp_group=None, **kwargs):
    """The registered attention function (HF's signature); `inner` is the implementation it stands in for."""
    if flashdapo_bounds is None:  # not a packed training forward: the inner implementation as HF runs it
        return _as_inner(module, inner, query, key, value, attention_mask, **kwargs)
    return _attend_packed(query, key, value, inner, flashdapo_bounds, flashdapo_sp_group, **kwargs), None


def _attend_packed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, inner: str,
                   bounds: DocumentBounds, sp_group, *, scaling: float | None = None,
                   sliding_window: int | None = None, softcap: float | None = None,
                   s_aux: torch.Tensor | None = None, **_) -> torch.Tensor:
    """Per-document attention of a packed row (this rank's sequence shard of it under sequence parallelism,
    which the all-to-alls turn into a head shard of the whole row and back). [1, T, H, D]. `softcap` and
    `s_aux` (the sinks, one per query head) are HF's keyword arguments of Gemma 2/3 and GPT-OSS."""
    sinks = s_aux
    if sp_group is not None:  # sequence shards -> head shards of the whole row
        sp = dist.get_world_size(sp_group)
        key, value = (expand_kv_heads(t, sp) for t in (key, value))
        query, key, value = (sequence_to_heads(t, sp_group) for t in (query, key, value))
        if sinks is not None:  # this rank's heads' sinks only
            sinks = local_heads(sinks, sp_group)
    if inner == "flash_attention_2":
        if sinks is not None:  # use_packed_attention refuses this at start-up
            raise ConfigError(_FLASH_SINKS.format(model="this model"))
        out = flash_document_attention(query, key, value, bounds, scaling, sliding_window, softcap)
    elif inner == INVARIANT_INNER:  # trainer.batch_invariant: every document's keys anchored at its start
        out = invariant_document_attention(query, key, value, bounds.offsets, scaling)
    else:
        out = document_attention(query, key, value, bounds.offsets, scaling, sliding_window, softcap, sinks)
    if sp_group is not None:  # head shards -> this rank's sequence shard, all heads
        out = heads_to_sequence(out, sp_group)
    return out


INVARIANT_INNER = "flashdapo_invariant"
"""models/invariant.py's attention (trainer.batch_invariant), as the packed path's inner implementation."""


def invariant_document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 offsets: Sequence[int], scaling: float | None) -> torch.Tensor:
    """Causal attention of each document of a packed row [1, H, T, D] over its own keys, in key blocks
    anchored at its start (kernels.invariant_attention): a query's bits are those of the same position in a
    decode step over its document alone. The documents are laid side by side as rows of their longest
    length (one anchor a row: each block's keys gathered once a document), and their outputs put back.
    [1, T, H, D]; filler past the last document (sequence parallelism) gets zeros."""
    starts, lengths = list(offsets[:-1]), [e - s for s, e in zip(offsets[:-1], offsets[1:])]
    device, total = query.device, query.shape[2]
    out = query.new_zeros(1, total, query.shape[1], value.shape[-1])
    if not starts:
        return out
    width = max(lengths)
    at = torch.arange(width)
    index = (torch.tensor(starts)[:, None] + at).clamp(max=total - 1).to(device)  # [docs, width]
    q, k, v = (t[0][:, index].transpose(0, 1) for t in (query, key, value))  # [docs, heads, width, D]
    count = (at + 1).expand(len(starts), width).to(device)
    first = torch.zeros_like(count)
    per_doc = invariant_attention(q, k, v, first, count,
                                  scaling if scaling is not None else query.shape[-1] ** -0.5)
    valid = (at[None] < torch.tensor(lengths)[:, None]).to(device)  # [docs, width]
    out[0, index[valid]] = per_doc[valid]
    return out


def _as_inner(module: nn.Module, inner: str, *args, **kwargs):
    """Call the inner implementation with the config naming it for the call (HF's flash-attn path reads the
    name from there to pick its kernels); eager is the module's own modeling file's function."""
    function = _eager_attention(module) if inner == "eager" else ALL_ATTENTION_FUNCTIONS[inner]
    config = module.config
    name, config._attn_implementation = config._attn_implementation, inner
    try:
        return function(module, *args, **kwargs)
    finally:
        config._attn_implementation = name


def _eager_attention(module: nn.Module):
    """The `eager_attention_forward` of the modeling file defining `module`'s class: what HF's layer calls for
    eager attention (transformers registers none; Gemma 2's caps the scores, GPT-OSS's adds the sinks)."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ConfigError(f"model.attn_implementation eager: {type(module).__module__} defines no "
                          f"eager_attention_forward for {type(module).__name__}; use sdpa")
    return eager


_FLASH_SINKS = ("model.attn_implementation flash_attention_2: {model}'s attention sinks are not supported by "
                "flash-attn's varlen kernel; use eager")


def has_attention_sinks(hf_model: nn.Module) -> bool:
    """Whether a layer of `hf_model` has attention sinks (GPT-OSS: a `sinks` logit per head)."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in hf_model.modules())


def attention_logit_softcap(config) -> float | None:
    """The attention-logit softcap of a model's config (Gemma 2/3: attn_logit_softcapping), None: none."""
    return getattr(config.get_text_config(), "attn_logit_softcapping", None)


@functools.cache
def packed_implementation(inner: str) -> str:
    """Register (once) and name the packed attention implementation standing in for `inner`."""
    name = PREFIX + inner
    AttentionInterface.register(name, functools.partial(_packed_attention, inner=inner))
    if inner in ALL_MASK_ATTENTION_FUNCTIONS:  # unpacked calls build the mask the inner one would
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


def use_packed_attention(hf_model: nn.Module) -> None:
    """Switch `hf_model` to the packed stand-in of its attention implementation (idempotent). One line
    (ConfigError) for flash-attn with attention sinks, which its varlen kernel cannot take. With SDPA and a
    softcap or sinks, which SDPA cannot take, the unpacked calls (sampling, padded rows) run the model's eager
    attention, so that they compute the model the packed path does."""
    # Gated DeltaNet layers (Qwen3.5) per document too: linear_attention.py
    use_document_linear_attention(hf_model)
    config = hf_model.config
    inner = config._attn_implementation
    if inner.startswith(PREFIX):
        return
    sinks = has_attention_sinks(hf_model)
    if inner == "flash_attention_2" and sinks:
        raise ConfigError(_FLASH_SINKS.format(model=config.model_type))
    # heads wider than flash-attn's (refused at start-up too)
    check_flash_attention(config, inner, "this model")
    if inner == "sdpa" and (sinks or attention_logit_softcap(config) is not None):
        inner = "eager"
    config._attn_implementation = packed_implementation(inner)


def packed_attention_kwargs(hf_model: nn.Module, bounds: DocumentBounds, sp_group=None) -> dict:
    """Keyword arguments of the HF model's forward for a packed row: the document boundaries (which the
    layers pass to the attention function; under HF's names too, cu_seq_lens_q/k and max_length_q/k), the
    sequence-parallel group, and a prepared mask so that the model builds no [T, T] one."""
    layer_types = getattr(hf_model.config, "layer_types", None)
    # Models with per-layer-type masks (Qwen2, Qwen3) take a prepared mapping and build nothing. The others
    # (Llama, Mistral) return any 4-D mask as prepared: given None they would see the positions restart and
    # build a [1, 1, T, T] document mask nobody reads. The packed attention reads only the bounds.
    empty = bounds.cu_seqlens.new_zeros((1, 1, 0, 0), dtype=torch.bool)
    mask = {t: None for t in set(layer_types)} if layer_types else empty
    return {"attention_mask": mask, "flashdapo_bounds": bounds, "flashdapo_sp_group": sp_group,
            "cu_seq_lens_q": bounds.cu_seqlens, "cu_seq_lens_k": bounds.cu_seqlens,
            "max_length_q": bounds.longest, "max_length_k": bounds.longest}


__all__ = ["DocumentBounds", "attention_logit_softcap", "document_attention", "flash_document_attention",
           "has_attention_sinks", "packed_attention_kwargs", "packed_implementation", "use_packed_attention"]

"""Linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3-Next) in packed rows: one document at a time.

A Gated DeltaNet layer runs a causal depthwise conv1d over the sequence and then a recurrent state (the gated
delta rule) over it. In a packed row [1, T] of several documents both would run across the boundaries (the
conv reads the previous document's last tokens, the state carries over), so a sample's log-probs would
depend on the samples packed before it. HF's layer passes `cu_seq_lens_q` only to the delta-rule kernel
(and only when flash-linear-attention is installed): its causal conv (the torch fallback or causal-conv1d's
kernel) and the torch delta rule ignore it.

So in a packed forward each linear-attention layer unpacks its input into the documents, runs HF's own
forward on them as right-padded batches [n, Lmax, hidden] (conv and recurrent state start at zero for every
document, on whichever kernels HF picks: flash-linear-attention's and causal-conv1d's when installed, its
torch reference otherwise) and packs the outputs back. Trailing pads cannot reach earlier tokens in a causal
layer, and no mask is passed (HF's 2-D mask would only zero the pads' inputs). Documents of similar length
share a batch (`length_groups`): the pads cost at most SLACK of the row's tokens however unequal the lengths
(one batch of D x Lmax tokens could be ten times T for one long response among short ones), in a few calls
of the layer. The full-attention layers stay per document without padding (`packing.py`). Passing the
boundaries to the kernels instead (fla's chunk_gated_delta_rule takes cu_seqlens, causal-conv1d's kernel a
seq_idx) would save the pads and the extra calls on a GPU; HF's layer forwards only the first of them.

`packing.use_packed_attention` wraps the layers (`use_document_linear_attention`) when it switches a model
to packed attention; they read the boundaries from the `flashdapo_bounds` keyword argument the packed forward
passes to every decoder layer (`packing.packed_attention_kwargs`; HF's decoder layer hands its keyword
arguments to the linear-attention module). Without it (the rollout engine sampling with its cache of conv
and recurrent states, a padded micro-batch) the layer is exactly HF's. The boundaries come with every call,
so the activation-checkpoint recompute in backward takes the same path as the forward.

Sequence parallelism (Ulysses) would hand each layer a shard of the row; the recurrence needs the whole
sequence, so `check_sequence_parallel` refuses it at start-up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ..distributed.mesh import SequenceParallelError

SLACK = 0.25
"""Pads allowed when the linear layers batch a row's documents, as a fraction of its tokens
(`length_groups`)."""

PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""HF's packed-row keyword arguments, dropped (with every flashdapo_* one) when the layer runs on the unpacked
documents: HF would hand cu_seq_lens_q to the delta-rule kernel as the padded batch's boundaries."""


def has_linear_attention(config) -> bool:
    """Whether a model has linear-attention layers: its config's layer_types name them (an HF config, or a
    config.json dict; a multimodal one's text config)."""
    if isinstance(config, dict):
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        layer_types = text.get("layer_types")
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layer_types = getattr(text, "layer_types", None)
    return "linear_attention" in (layer_types or ())


def linear_attention_modules(hf_model: nn.Module) -> list[nn.Module]:
    """The linear-attention modules of an HF model: the `linear_attn` of each decoder layer that has one
    (HF's name in Qwen3.5 and Qwen3-Next)."""
    return [
        module.linear_attn for module in hf_model.modules()
        if isinstance(getattr(module, "linear_attn", None), nn.Module)
    ]


def use_document_linear_attention(hf_model: nn.Module) -> int:
    """Make `hf_model`'s linear-attention layers run per document in packed forwards (idempotent); the number
    of layers. The modules keep their class and parameter names: only their instance's forward is wrapped."""
    modules = linear_attention_modules(hf_model)
    for module in modules:
        if "forward" not in vars(module):  # not wrapped yet
            module.forward = functools.partial(_document_forward, module.forward)
    return len(modules)


def check_sequence_parallel(config, sp: int) -> None:
    """One-line refusal of sequence parallelism (sp > 1) for a model with linear-attention layers (an HF
    config or a config.json dict: the launch planner checks the latter)."""
    if sp > 1 and has_linear_attention(config):
        model_type = config.get("model_type") if isinstance(config, dict) else getattr(
            config, "model_type", None)
        raise SequenceParallelError(
            f"trainer.sequence_parallel {sp}: {model_type}'s linear-attention layers (Gated DeltaNet) need "
            "the whole "
            "sequence on one rank, Ulysses gives each rank a shard of it; use trainer.sequence_parallel 1")


def _document_forward(forward: Callable, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                      *, flashdapo_bounds=None, **kwargs) -> torch.Tensor:
    """The wrapped layer's forward: HF's `forward` as it is unless called on a packed row (with its
    `packing.DocumentBounds`)."""
    if flashdapo_bounds is None:
        return forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    if cache_params is not None:  # a packed row never samples: the states of D documents share no cache
        raise ValueError(
            "a packed row (flashdapo_bounds) was passed with a cache; packed forwards run without one")
    kwargs = {k: v for k, v in kwargs.items() if k not in PACKED_KWARGS and not k.startswith("flashdapo_")}
    return document_linear_attention(forward, hidden_states, flashdapo_bounds.offsets, **kwargs)


def document_linear_attention(forward: Callable, hidden_states: torch.Tensor, offsets: Sequence[int],
                              **kwargs) -> torch.Tensor:
    """A causal sequence layer's `forward` ([B, L, H] -> [B, L, H']) on each document of a packed row [1, T,
    H] alone (`offsets`: [D + 1] host ints): documents of similar length as right-padded batches
    (`length_groups`), the outputs packed back in order, [1, T, H']. No device sync; differentiable."""
    if hidden_states.shape[0] != 1 or hidden_states.shape[1] != offsets[-1]:
        raise ValueError(
            f"a packed row of {offsets[-1]} tokens expected by its bounds, got hidden states "
            f"{tuple(hidden_states.shape)} (a sequence shard? linear attention needs the whole row)")
    lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
    if len(lengths) == 1:
        return forward(hidden_states, cache_params=None, attention_mask=None, **kwargs)
    documents = torch.split(hidden_states[0], lengths)
    outputs: list[torch.Tensor | None] = [None] * len(lengths)
    for group in length_groups(lengths):
        batch = pad_sequence([documents[i] for i in group], batch_first=True)  # [n, longest of the group, H]
        out = forward(batch, cache_params=None, attention_mask=None, **kwargs)
        for row, i in enumerate(group):
            outputs[i] = out[row, :lengths[i]]
    return torch.cat(outputs).unsqueeze(0)


def length_groups(lengths: list[int], slack: float = SLACK) -> list[list[int]]:
    """Documents (indices into `lengths`) in batches of similar length, as few as the padding allows: longest
    first, a document joins the current batch while the pads of all batches stay within `slack` x the row's
    tokens, else it starts the next one. Every index once."""
    budget, pads = slack * sum(lengths), 0
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        extra = lengths[groups[-1][0]] - lengths[i] if groups else 0  # pads of i in the current batch
        if groups and pads + extra <= budget:
            groups[-1].append(i)
            pads += extra
        else:
            groups.append([i])
    return groups


__all__ = [
    "PACKED_KWARGS", "SLACK", "check_sequence_parallel", "document_linear_attention", "has_linear_attention",
    "length_groups", "linear_attention_modules", "use_document_linear_attention"
]

"""What flash-attn's kernels cannot take of a model's attention, refused at start-up in one line
(`check_flash_attention`), from config.json before any weights load: a head dim above FLASH_MAX_HEAD_DIM.

Gemma 4's global (full-attention) layers have heads twice as wide as its sliding ones (`global_head_dim` 512
in the released models, head_dim 256): with model.attn_implementation flash_attention_2 every such layer would
stop the first forward inside flash-attn (packed micro-batches: models/packing.py, and HF's own flash path
when sampling). A config.json written by transformers 5 carries the wider layers' head dim as a per-layer
override (`per_layer_config`: {layer: {"head_dim": ...}}); both spellings are read."""

from __future__ import annotations

import json
from typing import Any

from ..errors import ConfigError

FLASH_MAX_HEAD_DIM = 256
"""The largest head dim flash-attn 2's kernels (flash_attn_func, flash_attn_varlen_func) take."""


def _as_dict(config: Any) -> dict:
    """A config.json dict of `config` (a dict already, or a transformers config), its text config if
    nested."""
    if not isinstance(config, dict):
        config = json.loads(config.to_json_string(use_diff=False))
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def layer_head_dims(config: Any) -> list[tuple[str, int]]:
    """(config field, head dim) of every attention head size the config gives its layers: `head_dim` (else
    hidden_size / num_attention_heads), Gemma 4's `global_head_dim`, and per-layer overrides."""
    text = _as_dict(config)
    heads = text.get("num_attention_heads")
    base = text.get("head_dim") or (text["hidden_size"] //
                                    heads if text.get("hidden_size") and heads else None)
    dims = [("head_dim", int(base))] if base else []
    if text.get("global_head_dim"):
        dims.append(("global_head_dim", int(text["global_head_dim"])))
    overrides = text.get("per_layer_config") or {}
    layers = sorted(overrides.items(), key=lambda item: int(item[0])) if isinstance(overrides, dict) else ()
    for layer, override in layers:
        if isinstance(override, dict) and override.get("head_dim"):
            dims.append((f"per_layer_config[{layer}].head_dim (layer {layer})", int(override["head_dim"])))
    return dims


def flash_attention_refusal(config: Any, attn_implementation: str) -> str | None:
    """Why flash-attn cannot run `config`'s attention (one clause naming the field and the layer head dim),
    None when it can or another implementation is chosen."""
    if attn_implementation != "flash_attention_2":
        return None
    wide = [(field, dim) for field, dim in layer_head_dims(config) if dim > FLASH_MAX_HEAD_DIM]
    if not wide:
        return None
    field, dim = wide[0]
    return (f"{field} {dim}: a layer head dim above flash-attn's limit of {FLASH_MAX_HEAD_DIM}; use "
            "--model.attn-implementation sdpa")


def check_flash_attention(config: Any, attn_implementation: str, where: str) -> None:
    """ConfigError in one line when model.attn_implementation `attn_implementation` is flash-attn and `config`
    (config.json dict or transformers config, of the model at `where`) has heads wider than its kernels
    take."""
    reason = flash_attention_refusal(config, attn_implementation)
    if reason is not None:
        model_type = _as_dict(config).get("model_type", "?")
        raise ConfigError(
            f"model.attn_implementation={attn_implementation}: {model_type} at {where}: {reason}")


__all__ = ["FLASH_MAX_HEAD_DIM", "check_flash_attention", "flash_attention_refusal", "layer_head_dims"]

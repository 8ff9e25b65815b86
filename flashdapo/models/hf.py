"""The model-family registry: what flashdapo needs to know about each HF family it trains.

One `Family` entry per config.json `model_type`. Every place that depends on a model's layout asks here:
the start-up check (which types are accepted), the policy wrapper (decoder blocks, LM head), FSDP2 and
activation checkpointing (the blocks to wrap), the packed attention (whether the model takes per-layer-type
masks), the vLLM push check (the parameter groups it hooks on both sides), resume (the config keys whose
change makes a checkpoint's weights not fit) and the KV-cache keyword of sampling.

Adding a family is one entry in FAMILIES plus a row in the family test matrix (tests/models/).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


def _qwen2_style_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def _qwen2_style_groups(model: nn.Module) -> list[tuple[str, nn.Module]]:
    inner = model.model
    groups = [("embed_tokens", inner.embed_tokens)]
    groups += [(f"layers.{i}", layer) for i, layer in enumerate(inner.layers)]
    return groups + [("norm", inner.norm)]


@dataclass(frozen=True)
class Family:
    """What flashdapo needs of one HF model family (config.json `model_type`)."""

    model_type: str
    decoder_layers: Callable[[nn.Module], nn.ModuleList] = _qwen2_style_layers
    """The HF ...ForCausalLM's decoder blocks, in order: FSDP2 and activation checkpointing wrap each."""
    groups: Callable[[nn.Module], list[tuple[str, nn.Module]]] = _qwen2_style_groups
    """(name, module) of the embedding, each decoder block and the final norm, the same on the HF model and on
    vLLM's: the push check hooks them to name where the two forwards part."""
    config_keys: tuple[str, ...] = ()
    """Config fields beyond COMMON_CONFIG_KEYS that decide the parameters' shapes (resume compares them)."""


COMMON_CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                      "attention_bias", "mlp_bias")
"""HF config fields that decide the parameters' shapes in every family (those a config has are recorded)."""

FAMILIES: dict[str, Family] = {family.model_type: family for family in (
    Family("qwen2"),
    Family("qwen3"),
    Family("llama"),
    Family("mistral"),
)}
"""The accepted families, by config.json `model_type` (tests/models/ runs each)."""

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_of(config) -> Family:
    """The registry entry of an HF config (object or config.json dict); KeyError for an unknown type (the
    start-up check, preflight.check_model_config, refuses those in one line first)."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return FAMILIES[model_type]


def decoder_layers(hf_model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of an HF causal LM of a registered family."""
    return family_of(hf_model.config).decoder_layers(hf_model)


def group_modules(model: nn.Module, model_type: str) -> list[tuple[str, nn.Module]]:
    """(group name, module) for the embedding, each decoder block and the final norm of `model` (an HF
    ...ForCausalLM or vLLM's model of the same family)."""
    return FAMILIES[model_type].groups(model)


def config_keys(config) -> tuple[str, ...]:
    """The HF config fields that decide the parameters' shapes for this config's family."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    return COMMON_CONFIG_KEYS + (family.config_keys if family is not None else ())


def final_logit_softcap(config) -> float | None:
    """The config's final-logit softcapping (`cap * tanh(z / cap)` on the logits: Gemma 2, 3 and 4; the text
    config of a multimodal one), None when it has none: the LM-head kernels apply it (flashdapo.kernels)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    return float(cap) if cap else None


def cache_argument(model: nn.Module) -> str:
    """The KV-cache keyword of `model`'s forward: `cache` in transformers 5.x (`past_key_values` is
    deprecated there), `past_key_values` in 4.x. inspect.signature follows decorators' __wrapped__."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


__all__ = ["COMMON_CONFIG_KEYS", "FAMILIES", "Family", "SUPPORTED_MODEL_TYPES", "cache_argument", "config_keys",
           "decoder_layers", "family_of", "final_logit_softcap", "group_modules"]

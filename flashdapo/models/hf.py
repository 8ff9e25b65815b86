"""The model-family registry: what flashdapo needs to know about each HF family it trains.

One `Family` entry per config.json `model_type`. Every place that depends on a model's layout asks here:
the start-up check (which types are accepted), the policy wrapper (decoder blocks, LM head), FSDP2 and
activation checkpointing (the blocks to wrap), the packed attention (whether the model takes per-layer-type
masks), the vLLM push check (the parameter groups it hooks on both sides), resume (the config keys whose
change makes a checkpoint's weights not fit, and those whose change makes the same weights compute another
function) and the KV-cache keyword of sampling. What a path cannot honour
of a family is said here too, for the start-up checks to refuse in one line: multimodal checkpoints
(`multimodal_refusal`), the installed vLLM (`vllm_refusal`), an attention implementation
(`attention_refusal`).

Adding a family is one entry in FAMILIES plus a row in the family test matrix (tests/models/test_families.py;
docs/models.md).
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


def _sparse_block_routers(model: nn.Module) -> list[nn.Module]:
    """The `mlp.gate` of every decoder block whose MLP is a sparse MoE block (dense blocks have no `gate`
    module: their `gate_proj` is a Linear)."""
    return [
        layer.mlp.gate for layer in model.model.layers
        if isinstance(getattr(layer.mlp, "gate", None), nn.Module)
    ]


def _gpt_oss_routers(model: nn.Module) -> list[nn.Module]:
    """GPT-OSS's `mlp.router` of every decoder block (every block is sparse): a linear router with a bias
    whose forward returns (logits, softmax over the top-k logits, top-k indices)."""
    return [layer.mlp.router for layer in model.model.layers]


def _gpt_oss_groups(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """GPT-OSS's groups: vLLM's model names its embedding `embedding` (transformers' `embed_tokens`)."""
    inner = model.model
    embedding = inner.embedding if hasattr(inner, "embedding") else inner.embed_tokens
    groups = [("embed_tokens", embedding)] + [(f"layers.{i}", layer) for i, layer in enumerate(inner.layers)]
    return groups + [("norm", inner.norm)]


def _scaled_embedding_groups(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Gemma's groups: transformers scales the embedding by sqrt(hidden) inside embed_tokens, vLLM after it,
    so the two embed_tokens outputs differ by that factor; on vLLM's model the group is left out (the push
    check compares the groups both sides recorded, from the first decoder block on)."""
    groups = _qwen2_style_groups(model)
    return groups[1:] if type(model).__module__.startswith("vllm.") else groups


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
    function_keys: tuple[str, ...] = ()
    """Config fields beyond COMMON_FUNCTION_KEYS that change the function the same weights compute (caps,
    windows, layer types, activation, routing; resume records and compares them, and checkpoint.allow_changes
    may accept a change). Each is an attribute of the family's transformers config class
    (tests/models/test_families.py)."""
    routers: Callable[[nn.Module], list[nn.Module]] | None = None
    """Mixture-of-experts families: the HF model's top-k routers, one per sparse block in layer order (each
    with `num_experts` and `top_k`, its forward returning the router logits first; flashdapo/models/moe/);
    None: dense."""
    router_loss: bool = True
    """MoE: softmax top-k routers balanced by transformers' load_balancing_loss_func (the router loss and
    expert load of models/moe/); False: routers balanced otherwise (no router loss, no expert-load
    metrics)."""
    engine_experts: str | None = None
    """MoE: how an engine that loads checkpoint names (vLLM, sync/vllm.py) takes the routed experts the HF
    model holds fused: "per_expert" (`...experts.<e>.{gate,up,down}_proj.weight`, the inverse of transformers'
    qwen2_moe conversion: models/moe/expert_layout.py), "gpt_oss" (vLLM's own names, one expert at a time, the
    attention sinks apart: models/moe/gpt_oss_layout.py); None: every tensor as held (dense families)."""
    adapter_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                        "down_proj")
    """The decoder's linear modules that take LoRA adapters by default (lora.target_modules empty;
    models/lora.py): attention and dense MLP projections, shared experts included. Never the routers, nor the
    routed experts transformers holds fused as 3-D parameters (no linear module to adapt)."""


COMMON_CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                      "attention_bias", "mlp_bias")
"""HF config fields that decide the parameters' shapes in every family (those a config has are recorded)."""

GEMMA4_CONFIG_KEYS = ("layer_types", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
                      "attention_k_eq_v", "num_kv_shared_layers", "use_double_wide_mlp", "enable_moe_block",
                      "num_experts", "moe_intermediate_size")
"""Gemma 4 (text): the layer types decide which layers get the wider global heads (head_dim 512 in the real
models: the config's per_layer_config), and the per-layer inputs, K = V sharing, KV-shared layers, the
double-wide MLP and the MoE block change the parameters too."""

COMMON_FUNCTION_KEYS = ("rope_parameters", "rms_norm_eps", "max_position_embeddings")
"""HF config fields that change the function of the same weights in every family: the rotary embedding
(transformers 5 folds a config.json's `rope_theta`, `rope_scaling` and `partial_rotary_factor` into
`rope_parameters`, per layer type where a family has two), the norms' epsilon, and the positions that dynamic,
YaRN and LongRoPE scaling compute their frequencies from (only under those: POSITION_SCALED_ROPE). Dropout
rates are not among them: the policy trains in eval mode (from_pretrained's), where transformers applies no
dropout."""

POSITION_SCALED_ROPE = ("dynamic", "yarn", "longrope")
"""Rope types whose frequencies read `max_position_embeddings` (transformers' modeling_rope_utils); under any
other it only bounds the positions (flashdapo's toy model sizes it to the run's lengths), so it is not
recorded."""

_ACT = ("hidden_act",)
_GEMMA_ACT = ("hidden_activation",)
_QWEN2_WINDOWS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
"""Qwen2-style windows: on or off, the width, and which layers (the first max_window_layers, as
layer_types)."""
_LAYER_WINDOWS = ("sliding_window", "layer_types")
"""Sliding-window layers named per layer (Gemma, OLMo 3, GPT-OSS)."""
_GEMMA_ATTENTION = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                    "use_bidirectional_attention")
"""Gemma 2/3's attention scale, attention-logit and final-logit caps, and the bidirectional mask switch."""

LINEAR_ATTENTION_CONFIG_KEYS = ("layer_types", "linear_num_key_heads", "linear_num_value_heads",
                                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
"""Gated DeltaNet families (Qwen3.5, Qwen3-Next): which layers are linear attention, and those layers'
shapes."""

LINEAR_ATTENTION_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz",
                                "in_proj_ba", "out_proj")
"""Gated DeltaNet's linear projections (Qwen3.5 ships q/k/v and z apart, Qwen3-Next fused), adapted besides
the full-attention and MLP ones."""

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("qwen2", function_keys=_ACT + _QWEN2_WINDOWS),
        Family("qwen3", function_keys=_ACT + _QWEN2_WINDOWS),
        Family("llama", function_keys=_ACT),
        Family("mistral", function_keys=_ACT + ("sliding_window", )),
        # Gemma 2/3/4 (text): HF scales the embedding by sqrt(hidden) in the model's forward (Gemma 2) or
        # inside embed_tokens (3, 4), ties the head by default and caps the final logits (the LM-head kernels
        # apply the cap: final_logit_softcap); Gemma 2 caps attention scores too (the packed attention applies
        # it).
        Family("gemma2", groups=_scaled_embedding_groups, function_keys=_GEMMA_ACT + _LAYER_WINDOWS +
               _GEMMA_ATTENTION),
        Family("gemma3_text", groups=_scaled_embedding_groups, function_keys=_GEMMA_ACT + _LAYER_WINDOWS +
               _GEMMA_ATTENTION),
        Family(
            "gemma4_text", groups=_scaled_embedding_groups, config_keys=GEMMA4_CONFIG_KEYS,
            function_keys=_GEMMA_ACT +
            ("sliding_window", "final_logit_softcapping", "use_bidirectional_attention", "top_k_experts")),
        Family("phi3", function_keys=_ACT + ("sliding_window", ),
               adapter_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),  # fused qkv / gate_up
        Family("olmo2", function_keys=_ACT),  # norms after attention and MLP only, q/k norms over all heads
        Family("olmo3", function_keys=_ACT + _LAYER_WINDOWS),  # OLMo 2's layout with sliding-window layers
        # GPT-OSS: attention sinks (parameters: their shapes are recorded) and sliding-window layers (the
        # packed attention honours both); its experts are transformers' fused ones (gate_up_proj / down_proj
        # tensors per layer, interleaved gate/up, with biases, a clamped SwiGLU), trained in the HF forward.
        # Its routers are softmax top-k ones (the softmax over the k picked logits is the full softmax
        # renormalised over them): transformers balances them with the same load_balancing_loss_func.
        Family("gpt_oss", groups=_gpt_oss_groups, routers=_gpt_oss_routers, config_keys=(
            "num_local_experts", ), engine_experts="gpt_oss", function_keys=_LAYER_WINDOWS +
               ("num_experts_per_tok", "swiglu_alpha", "swiglu_limit")),
        Family(
            "qwen3_moe", routers=_sparse_block_routers, engine_experts="per_expert", config_keys=(
                "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                "mlp_only_layers"), function_keys=_ACT +
            ("use_sliding_window", "sliding_window", "norm_topk_prob")),
        # DeepSeek-V3: multi-head latent attention, a shared expert, routers picking by sigmoid score plus a
        # correction bias within groups. That bias is balanced without a loss (updated outside the gradient in
        # pre-training; transformers keeps it a fixed buffer, and so does training here); no router loss.
        Family(
            "deepseek_v3", routers=_sparse_block_routers, router_loss=False, engine_experts="per_expert",
            config_keys=("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                         "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                         "moe_intermediate_size", "first_k_dense_replace"), function_keys=_ACT +
            ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "rope_interleave"),
            adapter_modules=("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                             "gate_proj", "up_proj", "down_proj")),
        # Qwen3.5: Gated DeltaNet (linear attention) layers between full-attention ones
        # (models/linear_attention.py); Qwen3-Next: the same layers, sparse MoE blocks with a shared expert.
        Family("qwen3_5_text", config_keys=LINEAR_ATTENTION_CONFIG_KEYS, function_keys=_ACT,
               adapter_modules=Family.adapter_modules + LINEAR_ATTENTION_PROJECTIONS),
        Family(
            "qwen3_next", routers=_sparse_block_routers, engine_experts="per_expert",
            config_keys=LINEAR_ATTENTION_CONFIG_KEYS +
            ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
             "decoder_sparse_step", "mlp_only_layers"), function_keys=_ACT + ("norm_topk_prob", ),
            adapter_modules=Family.adapter_modules + LINEAR_ATTENTION_PROJECTIONS),
    )
}
"""The accepted families, by config.json `model_type` (tests/models/ runs each)."""

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

MULTIMODAL_MODEL_TYPES = {
    "gemma3": ("Gemma3ForConditionalGeneration", "gemma3_text", "Gemma3ForCausalLM"),
    "gemma4": ("Gemma4ForConditionalGeneration", "gemma4_text", "Gemma4ForCausalLM"),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "qwen3_5_text", "Qwen3_5ForCausalLM"),
}
"""Multimodal checkpoints whose text model is a registered family: (their class, the text model's model_type
and class). transformers 5.19's AutoModelForCausalLM builds the whole multimodal model for them (vision tower,
model.language_model) and Gemma3ForCausalLM.from_pretrained does not map their weights, so they are refused,
naming the text checkpoint to train instead (docs/models.md converts one). Qwen3.5 as released is such a
checkpoint too (its shape fields sit under text_config, which the start-up checks do not read)."""


def multimodal_refusal(model_type: str | None) -> str | None:
    """What to do with a multimodal checkpoint whose text model flashdapo trains (MULTIMODAL_MODEL_TYPES), as
    one sentence; None for any other model_type."""
    if model_type not in MULTIMODAL_MODEL_TYPES:
        return None
    whole, text_type, text_class = MULTIMODAL_MODEL_TYPES[model_type]
    return (
        f"model_type {model_type!r} is the multimodal {whole}, which flashdapo does not train: train its "
        "text "
        f"model as a {text_type} checkpoint ({text_class} of its text_config holding model.language_model's "
        "weights; docs/models.md shows the conversion)")


VLLM_UNSUPPORTED = {
    "olmo2": "vLLM runs OLMo 2 only through its Transformers backend, which rewrites transformers' "
             "Olmo2Model "
    "class in the process the trainer shares (the policy's own forward then fails)",
    "olmo3": "vLLM runs OLMo 3 only through its Transformers backend, which rewrites transformers' "
             "Olmo3Model "
    "class in the process the trainer shares (the policy's own forward then fails)",
}
"""Families whose weight push the installed vLLM (0.32) cannot take, and why (tests/models/test_families.py
runs each family's push on vLLM's CPU build)."""


def vllm_refusal(config, on_gpu: bool) -> str | None:
    """Why rollout.engine vllm cannot serve this config's model (a config object or config.json dict), as one
    clause; None when it can. Device-bound, on vLLM's CPU build: Gemma 2's attention-logit softcap (its CPU
    attention leaves it out: the push check measured it; its CUDA backends apply it), and Gated DeltaNet
    layers (Qwen3.5, Qwen3-Next), which vLLM 0.32 runs on CPU only in bfloat16 ("CPU GDN attention requires
    BF16", and its CPU kernel refuses a linear head size of 32; 128, the released models', runs) and, with
    prefix caching on (flashdapo's engine keeps it on), only with chunked prefill ("Chunked prefill is
    required for mamba cache mode 'align'"), which flashdapo's CPU engine turns off (rollout/vllm_bounds.py);
    and DeepSeek-V3, whose multi-head latent attention hands vLLM's CPU rotary kernel
    (`_custom_ops.rotary_embedding`) a 3-D query [tokens, heads, rope], which that kernel rotates wrong past
    the first head (a 2-D [tokens, heads * rope] one, as the other families pass, it rotates right), and whose
    MoE layers, that fixed, still give other log-probs."""
    get = config.get if isinstance(config,
                                   dict) else (lambda key, default=None: getattr(config, key, default))
    model_type = get("model_type")
    if model_type in VLLM_UNSUPPORTED:
        return VLLM_UNSUPPORTED[model_type]
    if on_gpu:
        return None
    if model_type == "gemma2" and get("attn_logit_softcapping"):
        return (
            f"its attention-logit softcapping (attn_logit_softcapping={get('attn_logit_softcapping')}) is "
            "left "
            "out by vLLM's CPU attention")
    if model_type == "deepseek_v3":
        return (
            "vLLM's CPU build computes DeepSeek-V3 differently from transformers, loaded from disk or pushed "
            "alike: its CPU rotary_embedding kernel rotates the [tokens, heads, rope] query of multi-head "
            "latent "
            "attention wrong past the first head, and its MoE layers differ too (up to 5 and 2 nats of "
            "log-prob on a 2-layer model whose weights it loads exactly)")
    if "linear_attention" in (get("layer_types") or ()):
        return (
            "its Gated DeltaNet (linear-attention) layers run on vLLM's CPU build only in bfloat16 and, "
            "under "
            "the prefix caching the engine keeps on, only with chunked prefill, which flashdapo turns off on "
            "CPU"
        )
    return None


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
    """The HF config fields that decide the parameters' shapes for this config's family, less those the config
    holds per layer (Gemma 4's head_dim: transformers refuses to read one value for every layer; the
    parameters' shapes, recorded too, cover them)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    keys = COMMON_CONFIG_KEYS + (family.config_keys if family is not None else ())
    return tuple(key for key in keys if _global_value(config, key))


def function_keys(config) -> tuple[str, ...]:
    """The HF config fields whose change makes this config's family compute another function of the same
    weights (COMMON_FUNCTION_KEYS and the family's own; none for an unregistered type), less those
    transformers refuses to read for the whole config (held per layer)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        return ()
    keys = COMMON_FUNCTION_KEYS + family.function_keys
    if not _rope_types(config) & set(POSITION_SCALED_ROPE):
        keys = tuple(key for key in keys if key != "max_position_embeddings")
    return tuple(key for key in keys if _global_value(config, key))


def _rope_types(config) -> set[str]:
    """The rope types of a config's rope_parameters (one, or one per layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    per_layer = [value for value in params.values() if isinstance(value, dict)]
    return {p.get("rope_type", "default") for p in per_layer or [params]}


def _global_value(config, key: str) -> bool:
    """Whether reading `key` of `config` is not refused (a missing key is: the caller skips those)."""
    try:
        getattr(config, key, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError, whatever its base
        return False
    return True


ATTENTION_REFUSED = {
    ("gpt_oss", "sdpa"): "transformers has no SDPA path for GPT-OSS (its attention sinks)",
    ("gemma2", "sdpa"): "transformers' SDPA path leaves Gemma 2's attention-logit softcapping out (sampling "
                        "and "
    "padded micro-batches would attend with uncapped scores)",
}
"""(model_type, model.attn_implementation) pairs whose transformers modeling cannot honour the family's
attention, and why (the packed attention honours caps and sinks itself; HF's own calls do not)."""


def attention_refusal(config: dict, attn_implementation: str) -> str | None:
    """Why model.attn_implementation cannot run this config.json's family right (one clause), None when it
    can. Gemma 2 only with an attention-logit cap set (every released Gemma 2 has 50.0)."""
    model_type = config.get("model_type")
    reason = ATTENTION_REFUSED.get((model_type, attn_implementation))
    if reason is None or (model_type == "gemma2" and not config.get("attn_logit_softcapping")):
        return None
    return f"{reason}; use --model.attn-implementation eager"


def resolved_attention(choice: str, config) -> str:
    """model.attn_implementation `choice` made concrete for a config (object or config.json dict; None: the
    built-in toy model): `auto` is SDPA, or eager for a family SDPA cannot run right (ATTENTION_REFUSED); an
    explicit choice stays as given (the start-up check refuses it where it cannot run)."""
    if choice != "auto":
        return choice
    if config is not None and not isinstance(config, dict):
        config = config.to_dict()
    return "eager" if config is not None and attention_refusal(config, "sdpa") is not None else "sdpa"


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


def layer_configs(config) -> list:
    """The config each decoder layer is built from: a heterogeneous config's per-layer ones (Gemma 4's
    full-attention layers carry their own key/value heads and head dim; transformers refuses to read such
    attributes from the whole config), else the config itself, once for all."""
    return list(config.per_layer_config) if getattr(config, "is_heterogeneous", False) else [config]


__all__ = [
    "ATTENTION_REFUSED", "COMMON_CONFIG_KEYS", "COMMON_FUNCTION_KEYS", "FAMILIES", "Family",
    "MULTIMODAL_MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "VLLM_UNSUPPORTED", "attention_refusal",
    "cache_argument", "config_keys", "decoder_layers", "family_of", "final_logit_softcap", "function_keys",
    "group_modules", "layer_configs", "multimodal_refusal", "resolved_attention", "vllm_refusal"
]

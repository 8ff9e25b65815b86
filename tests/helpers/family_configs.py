"""Tiny configs of every model family the family matrix (tests/models/test_families.py) runs: 2 decoder layers,
each family's own special parts switched on at a size where they matter (a sliding window shorter than the
test's sequences, Gemma's caps and embedding scale, Gemma 4's wider global heads and per-layer inputs,
GPT-OSS's sinks and experts, Qwen3.5's linear attention), the toy task's tokenizer below the vocabulary.

`family_config(model_type)` is the torch rows' size (head size 8); `family_config(model_type, vllm=True)` the
vLLM rows' (head size 32, the smallest vLLM's CPU attention takes)."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

VOCAB = 291
"""Rows of every tiny model: odd, above the toy tokenizer's 289 ids (an export carries that tokenizer)."""
WINDOW = 4
INIT = 0.2
"""The sliding window of the families that have one: shorter than most test sequences, so it bends them."""

MATRIX = ("qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3_text", "gemma4_text", "phi3", "olmo2", "olmo3",
          "gpt_oss", "qwen3_5_text", "qwen3_moe", "deepseek_v3", "qwen3_next")
"""The matrix's rows, by config.json model_type."""

VLLM_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                      "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                      "gemma4_text": "Gemma4ForCausalLM", "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                      "olmo3": "Olmo3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                      "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                      "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
"""The HF class of each row, the `architectures` entry vLLM picks its model by."""
ATTENTION = {"gpt_oss": "eager", "gemma2": "eager"}
"""model.attn_implementation where it is not sdpa, as flashdapo requires it at start-up (models/hf.py
ATTENTION_REFUSED): transformers 5.19 has no SDPA path for GPT-OSS (its sinks) and its SDPA path leaves Gemma 2's
attention-logit cap out."""


def _special(model_type: str, head_dim: int) -> dict:
    """Each family's own parts, switched on (HF's defaults where they already are)."""
    sliding = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
    return {
        "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        "qwen3": {"head_dim": head_dim},
        "llama": {},
        "mistral": {"sliding_window": WINDOW},
        # Gemma 2: both caps (the attention one small enough to bend the tiny model's scores), the scaled
        # embedding and the sandwich norms come with the architecture.
        "gemma2": {"head_dim": head_dim, "final_logit_softcapping": 3.0, "attn_logit_softcapping": 2.0,
                   "query_pre_attn_scalar": head_dim, **sliding},
        "gemma3_text": {"head_dim": head_dim, "final_logit_softcapping": 3.0, **sliding},
        # Gemma 4: global layers with heads twice as wide (512 vs 256 in the real models), per-layer inputs.
        "gemma4_text": {"head_dim": head_dim, "global_head_dim": 2 * head_dim, "final_logit_softcapping": 3.0,
                        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB, **sliding},
        "phi3": {"pad_token_id": 0, "sliding_window": WINDOW},
        "olmo2": {"pad_token_id": 0},
        "olmo3": {"pad_token_id": 0, **sliding},
        "gpt_oss": {"head_dim": head_dim, "num_local_experts": 4, "num_experts_per_tok": 2, **sliding},
        "qwen3_5_text": {"head_dim": head_dim, "linear_key_head_dim": head_dim, "linear_value_head_dim": head_dim,
                         "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                         "layer_types": ["linear_attention", "full_attention"]},
        # Qwen3-MoE: sparse blocks on every layer (4 experts, top 2), no shared expert
        "qwen3_moe": {"head_dim": head_dim, "num_experts": 4, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 2 * head_dim, "experts_implementation": "eager"},
        # DeepSeek-V3: multi-head latent attention, layer 0 dense, then 4 routed experts in 2 groups and a shared one
        # (vLLM rows: the latent cache's size, kv_lora_rank + qk_rope_head_dim, is 576 as in the real model, the one
        # size vLLM's CPU MLA backend takes, v1/attention/backends/mla/cpu_mla.py)
        "deepseek_v3": {"num_key_value_heads": None, "n_routed_experts": 4, "n_shared_experts": 1,
                        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                        "kv_lora_rank": 16 if head_dim < 32 else 512, "q_lora_rank": 24,
                        "qk_rope_head_dim": 4 if head_dim < 32 else 64, "qk_nope_head_dim": head_dim,
                        "v_head_dim": head_dim, "moe_intermediate_size": 2 * head_dim, "topk_method": "noaux_tc",
                        "experts_implementation": "eager"},
        # Qwen3-Next: Qwen3.5's layers with sparse MoE blocks (4 experts, top 2, a shared expert)
        "qwen3_next": {"head_dim": head_dim, "linear_key_head_dim": head_dim, "linear_value_head_dim": head_dim,
                       "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4,
                       "num_experts_per_tok": 2, "moe_intermediate_size": 2 * head_dim,
                       "shared_expert_intermediate_size": 2 * head_dim, "experts_implementation": "eager",
                       "layer_types": ["linear_attention", "full_attention"]},
    }[model_type]


def family_config(model_type: str, vllm: bool = False, layers: int = 2, **overrides) -> PretrainedConfig:
    """A tiny HF config of `model_type`: 4 query heads over 2 KV heads of size 8 (vllm: 2 over 1 of size 32),
    `layers` decoder layers, VOCAB rows, untied heads unless the family ties by default."""
    head_dim, heads, kv_heads = (32, 2, 1) if vllm else (8, 4, 2)
    shape = dict(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 max_position_embeddings=256, bos_token_id=1, eos_token_id=2, initializer_range=INIT)
    if model_type == "gpt_oss":
        shape["intermediate_size"] = heads * head_dim  # per expert
    if model_type not in VLLM_ARCHITECTURES:
        raise KeyError(f"{model_type}: no tiny config in tests/helpers/family_configs.py (add its matrix row)")
    special = _special(model_type, head_dim)
    if "layer_types" in special:  # the two-layer pattern, repeated over `layers`
        special["layer_types"] = [special["layer_types"][i % 2] for i in range(layers)]
    config = AutoConfig.for_model(model_type, **{**shape, **special, **overrides})
    config.architectures = [VLLM_ARCHITECTURES[model_type]]
    return config


__all__ = ["ATTENTION", "MATRIX", "VLLM_ARCHITECTURES", "VOCAB", "WINDOW", "family_config"]

"""Tiny float64 models whose attention does more than causal softmax (tests/models/test_packed_attention_features.py
and its 2-rank script): Gemma 2 with an attention-logit softcap, GPT-OSS with attention sinks, a windowed Qwen2 for
eager attention. Each has a sliding layer (window 4) and a full one, and query/key projections scaled up so that
attention logits are O(1..10): a softcap of 0.5 bends them and softmaxes are far from uniform."""

from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 67
WINDOW = 4
SINKS = (2.0, -1.0, 0.5, 3.0)
"""GPT-OSS's sink logits per head, large enough to take a real share of each softmax (HF starts them near 0)."""
_LAYERS = ["sliding_attention", "full_attention"]


def _sharpen(model, scale: float):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(scale)
    return model.double().eval()


def gemma2_softcapped(cap: float) -> Gemma2ForCausalLM:
    """Gemma 2 with attn_logit_softcapping = cap (no final-logit cap), query_pre_attn_scalar 6 (not the head
    size 8: the passed scaling matters), eager attention."""
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                       attn_logit_softcapping=cap, final_logit_softcapping=None, sliding_window=WINDOW,
                       query_pre_attn_scalar=6, layer_types=_LAYERS, attn_implementation="eager")
    return _sharpen(Gemma2ForCausalLM(cfg), 12.0)


def gpt_oss_with_sinks() -> GptOssForCausalLM:
    """GPT-OSS (a MoE: 4 experts, top-2) with `SINKS`, eager attention and eager experts (torch's grouped_mm
    takes no float64)."""
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=WINDOW, layer_types=_LAYERS, max_position_embeddings=128,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       attn_implementation="eager", experts_implementation="eager")
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor(SINKS))
    return _sharpen(model, 6.0)


def qwen2_windowed() -> Qwen2ForCausalLM:
    """Qwen2 with a sliding layer (max_window_layers 1) and a full one, eager attention."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, attn_implementation="eager")
    return _sharpen(Qwen2ForCausalLM(cfg), 6.0)

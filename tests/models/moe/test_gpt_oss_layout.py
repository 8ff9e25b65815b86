"""GPT-OSS's transformers-named tensors in vLLM's names (models/moe/gpt_oss_layout.py): each fused expert tensor
(interleaved gate/up, biases) becomes its per-expert slices, views in the same order; the embedding and the
attention are renamed; the mapping of an already-mapped stream changes nothing; every name of a real tiny
GPT-OSS maps to a parameter vLLM 0.32's GptOssForCausalLM has (its names written out here). Wall budget: 5 s."""

import torch
from transformers import GptOssConfig, GptOssForCausalLM

from flashdapo.models.moe.gpt_oss_layout import is_sinks, to_vllm_gpt_oss

EXPERTS, HIDDEN, INTER = 3, 4, 5


def test_fused_experts_become_per_expert_views_in_vllms_names():
    g = torch.Generator().manual_seed(0)
    prefix = "model.layers.1.mlp.experts"
    stream = [("model.embed_tokens.weight", torch.randn(7, HIDDEN, generator=g)),
              ("model.layers.1.self_attn.q_proj.weight", torch.randn(HIDDEN, HIDDEN, generator=g)),
              ("model.layers.1.self_attn.sinks", torch.randn(2, generator=g)),
              ("model.layers.1.mlp.router.bias", torch.randn(EXPERTS, generator=g)),
              (f"{prefix}.gate_up_proj", torch.randn(EXPERTS, HIDDEN, 2 * INTER, generator=g)),
              (f"{prefix}.gate_up_proj_bias", torch.randn(EXPERTS, 2 * INTER, generator=g)),
              (f"{prefix}.down_proj", torch.randn(EXPERTS, INTER, HIDDEN, generator=g)),
              (f"{prefix}.down_proj_bias", torch.randn(EXPERTS, HIDDEN, generator=g)),
              ("lm_head.weight", torch.randn(7, HIDDEN, generator=g))]
    fused = dict(stream)
    mapped = list(to_vllm_gpt_oss(iter(stream)))
    names = [n for n, _ in mapped]
    assert names[:4] == ["model.embedding.weight", "model.layers.1.attn.q_proj.weight", "model.layers.1.attn.sinks",
                         "model.layers.1.mlp.router.bias"] and names[-1] == "lm_head.weight"
    assert len(mapped) == 5 + 4 * EXPERTS
    out = dict(mapped)
    for e in range(EXPERTS):
        for hf, vllm in (("gate_up_proj", "w13_weight"), ("gate_up_proj_bias", "w13_bias"), ("down_proj", "w2_weight"),
                         ("down_proj_bias", "w2_bias")):
            got = out[f"{prefix}.{e}.{vllm}"]
            assert torch.equal(got, fused[f"{prefix}.{hf}"][e])  # gate/up stay interleaved: vLLM's loader's order
            assert got.data_ptr() == fused[f"{prefix}.{hf}"][e].data_ptr()  # a view, no copy
    again = list(to_vllm_gpt_oss(iter(mapped)))
    assert [n for n, _ in again] == names and all(a is b for (_, a), (_, b) in zip(again, mapped))
    assert [n for n in names if is_sinks(n)] == ["model.layers.1.attn.sinks"]


def test_every_tensor_of_a_tiny_gpt_oss_maps_to_a_vllm_parameter():
    """vLLM 0.32's GptOssForCausalLM parameters (model_executor/models/gpt_oss.py), per layer, and where each
    per-expert tensor lands (`...experts.<e>.<param>` -> `...experts.routed_experts.<param>`)."""
    config = GptOssConfig(vocab_size=11, hidden_size=8, intermediate_size=4, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_local_experts=EXPERTS,
                          num_experts_per_tok=2, tie_word_embeddings=False)
    model = GptOssForCausalLM(config)
    vllm = {"model.embedding.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(2):
        layer = f"model.layers.{i}"
        vllm |= {f"{layer}.attn.sinks", f"{layer}.attn.o_proj.weight", f"{layer}.attn.o_proj.bias",
                 f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight",
                 f"{layer}.mlp.router.weight", f"{layer}.mlp.router.bias"}
        vllm |= {f"{layer}.attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")}  # stacked into qkv_proj
        vllm |= {f"{layer}.mlp.experts.{e}.{p}" for e in range(EXPERTS)
                 for p in ("w13_weight", "w13_bias", "w2_weight", "w2_bias")}
    names = [n for n, _ in to_vllm_gpt_oss(model.state_dict().items())]
    assert len(names) == len(set(names)) and set(names) == vllm

"""sync/vllm.py push_weights on a mixture-of-experts model, against a stand-in for vLLM's engine (no vLLM): the
fused expert tensors reach the loader split per expert (views, gate then up), completeness asks every expert's
w1, w3 and w2, and families whose fused tensors are not transformers' qwen2_moe layout pass through fused.
Real vLLM: tests/vllm/test_vllm_moe_push.py. Wall budget: 5 s."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flashdapo.sync.vllm import push_weights

EXPERTS, INTER, HIDDEN = 3, 4, 5


class _Model(nn.Module):
    """vLLM's parameter names of a 2-layer MoE model (shapes do not matter to the push's bookkeeping)."""

    def __init__(self, model_type: str):
        super().__init__()
        self.config = type("Config", (), {"model_type": model_type})()
        self.num_logical_experts = EXPERTS
        self.names = [f"model.layers.{i}.mlp.experts.routed_experts.{w}_weight" for i in (0, 1) for w in ("w13", "w2")]
        self.names.append("model.norm.weight")

    def named_parameters(self, *args, **kwargs):
        return [(name, None) for name in self.names]


class _Engine:
    def __init__(self, model_type: str):
        self.model, self.loaded = _Model(model_type), {}

    def apply_model(self, fn):
        return [fn(self.model)]

    def collective_rpc(self, method, kwargs):
        self.loaded.update(kwargs["weights_iterator"])


def _fused_stream():
    torch.manual_seed(0)
    stream = [("model.norm.weight", torch.ones(HIDDEN))]
    for i in (0, 1):
        stream += [(f"model.layers.{i}.mlp.experts.gate_up_proj", torch.randn(EXPERTS, 2 * INTER, HIDDEN)),
                   (f"model.layers.{i}.mlp.experts.down_proj", torch.randn(EXPERTS, HIDDEN, INTER))]
    return stream


def test_the_push_splits_fused_experts_for_vllms_loaders_and_checks_every_expert():
    engine, stream = _Engine("qwen3_moe"), _fused_stream()
    push_weights(engine, iter(stream))
    fused = dict(stream)
    assert len(engine.loaded) == 1 + 2 * 3 * EXPERTS
    for i in (0, 1):
        for e in range(EXPERTS):
            gate_up = fused[f"model.layers.{i}.mlp.experts.gate_up_proj"][e]
            assert torch.equal(engine.loaded[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"], gate_up[:INTER])
            assert torch.equal(engine.loaded[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"], gate_up[INTER:])
            assert torch.equal(engine.loaded[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"],
                               fused[f"model.layers.{i}.mlp.experts.down_proj"][e])


def test_a_stream_short_of_one_expert_or_of_a_layers_experts_is_refused():
    from flashdapo.models.moe.expert_layout import split_experts

    short = [(n, t) for n, t in split_experts(_fused_stream()) if n != "model.layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(RuntimeError, match=r"missing shards: \['model\.layers\.1\.mlp\.experts\.routed_experts\."
                                           r"w13_weight'\]"):
        push_weights(_Engine("qwen3_moe"), iter(short))
    # the highest expert missing everywhere: only the expert count tells
    last = [(n, t) for n, t in split_experts(_fused_stream()) if f".experts.{EXPERTS - 1}." not in n]
    with pytest.raises(RuntimeError, match=r"missing shards: \[.*layers\.0\.mlp\.experts\.routed_experts\.w13"):
        push_weights(_Engine("qwen3_moe"), iter(last))
    no_layer = [(n, t) for n, t in _fused_stream() if n != "model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(RuntimeError, match=r"unloaded: \['model\.layers\.0\.mlp\.experts\.routed_experts\.w2_weight'"):
        push_weights(_Engine("qwen3_moe"), iter(no_layer))


def test_other_families_fused_experts_pass_through_fused():
    engine = _Engine("llama4_text")  # [E, H, 2I]: not transformers' qwen2_moe layout, loaded fused (GPT-OSS's
    # are streamed one expert at a time in vLLM's names: tests/models/moe/test_gpt_oss_layout.py, tests/vllm/)
    push_weights(engine, iter(_fused_stream()))
    assert sorted(engine.loaded) == sorted(n for n, _ in _fused_stream())

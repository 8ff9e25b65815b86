"""sync/vllm.py push_weights on DeepSeek-V3's multi-head latent attention, against a stand-in for vLLM's engine (no
vLLM; the parameter names are those vLLM 0.32 builds for the family's tiny model): q_a_proj and kv_a_proj_with_mqa
complete vLLM's stacked `fused_qkv_a_proj`, and `W_UV` / `W_UK_T`, which vLLM derives from kv_b_proj when the reload
finishes, count as written exactly when kv_b_proj was. Real vLLM: tests/models/test_families.py (refused on the CPU
build, see models/hf.py vllm_refusal). Wall budget: 5 s."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flashdapo.sync.vllm import push_weights

ATTENTION = "model.layers.0.self_attn"
VLLM_NAMES = [f"{ATTENTION}.{name}" for name in (
    "fused_qkv_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_layernorm.weight",
    "kv_b_proj.weight", "o_proj.weight", "mla_attn.mla_attn.W_UV", "mla_attn.mla_attn.W_UK_T")]
HF_NAMES = [f"{ATTENTION}.{name}.weight" for name in (
    "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")]


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"model_type": "deepseek_v3"})()

    def named_parameters(self, *args, **kwargs):
        return [(name, None) for name in VLLM_NAMES]


class _Engine:
    def __init__(self):
        self.model, self.loaded = _Model(), {}

    def apply_model(self, fn):
        return [fn(self.model)]

    def collective_rpc(self, method, kwargs):
        self.loaded.update(kwargs["weights_iterator"])


def _stream(leave_out: str | None = None):
    return iter([(name, torch.zeros(3)) for name in HF_NAMES if leave_out is None or f".{leave_out}." not in name])


def test_the_whole_attention_stream_completes_every_mla_parameter():
    engine = _Engine()
    push_weights(engine, _stream())
    assert sorted(engine.loaded) == sorted(HF_NAMES)  # HF names go in unchanged: vLLM's loader stacks them


def test_a_stream_short_of_kv_a_proj_leaves_the_fused_projection_partial():
    with pytest.raises(RuntimeError, match=r"stacked parameters missing shards: \['model.layers.0.self_attn."
                                           r"fused_qkv_a_proj.weight'\]"):
        push_weights(_Engine(), _stream("kv_a_proj_with_mqa"))


def test_a_stream_short_of_kv_b_proj_leaves_its_derived_tensors_unloaded():
    with pytest.raises(RuntimeError) as err:
        push_weights(_Engine(), _stream("kv_b_proj"))
    missing = str(err.value).split("unloaded: ")[1].split(" (of ")[0]
    assert missing == str([f"{ATTENTION}.kv_b_proj.weight", f"{ATTENTION}.mla_attn.mla_attn.W_UV",
                           f"{ATTENTION}.mla_attn.mla_attn.W_UK_T"])

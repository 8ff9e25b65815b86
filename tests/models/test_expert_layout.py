"""models/moe/expert_layout.py: fused <-> per-expert expert tensors, exact both ways and the same as transformers'
own conversion (its save_pretrained writes a Qwen3-MoE or a DeepSeek-V3 per-expert, its from_pretrained fuses
them again; DeepSeek-V3's shared experts stay as they are), on a state dict and on a stream; which layout a
checkpoint directory holds, from its tensor names alone. Wall budget: 20 s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3MoeConfig

from flashdapo.models.moe.expert_layout import (
    FUSED,
    PER_EXPERT,
    checkpoint_expert_layout,
    fuse_experts,
    fused_expert_name,
    per_expert_name,
    split_experts,
    split_fused,
)


def tiny_qwen3_moe(seed: int = 0):
    """2 layers of 3 experts with odd sizes (intermediate 5, hidden 12): a swapped or misaligned half shows."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=37, hidden_size=12, intermediate_size=20, moe_intermediate_size=5,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=6,
                            num_experts=3, num_experts_per_tok=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # distinct values everywhere (the init leaves nothing equal by chance anyway)
        for p in model.parameters():
            p.normal_()
    return model


def test_names_parse_only_routed_experts():
    assert per_expert_name("model.layers.3.mlp.experts.17.up_proj.weight") == ("model.layers.3.mlp.experts", 17,
                                                                             "up_proj")
    assert fused_expert_name("model.layers.3.mlp.experts.gate_up_proj") == ("model.layers.3.mlp.experts",
                                                                          "gate_up_proj")
    for other in ("model.layers.0.mlp.shared_experts.gate_proj.weight",  # DeepSeek-V3's shared experts
                  "model.layers.0.mlp.shared_expert.up_proj.weight", "model.layers.0.mlp.gate.weight",
                  "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.experts.gate_up_proj.weight"):
        assert per_expert_name(other) is None and fused_expert_name(other) is None, other


def test_split_takes_gate_then_up_rows_and_down_per_expert():
    experts, inter, hidden = 3, 5, 7
    gate_up = torch.arange(experts * 2 * inter * hidden, dtype=torch.float64).view(experts, 2 * inter, hidden)
    parts = dict(split_fused("m.layers.1.mlp.experts.gate_up_proj", gate_up))
    assert list(parts) == [f"m.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(3) for p in ("gate", "up")]
    for e in range(experts):
        assert torch.equal(parts[f"m.layers.1.mlp.experts.{e}.gate_proj.weight"], gate_up[e, :inter])
        assert torch.equal(parts[f"m.layers.1.mlp.experts.{e}.up_proj.weight"], gate_up[e, inter:])
        assert parts[f"m.layers.1.mlp.experts.{e}.up_proj.weight"].data_ptr() == gate_up[e, inter:].data_ptr()
    down = torch.randn(experts, hidden, inter)
    assert [t.shape for _, t in split_fused("x.mlp.experts.down_proj", down)] == [(hidden, inter)] * experts
    with pytest.raises(ValueError, match="must be even"):
        split_fused("x.mlp.experts.gate_up_proj", torch.zeros(2, 5, 3))
    with pytest.raises(ValueError, match=r"expected a fused expert tensor"):
        split_fused("x.mlp.experts.down_proj", torch.zeros(5, 3))


def test_round_trip_is_exact_on_a_state_dict_and_keeps_the_order():
    state = tiny_qwen3_moe().state_dict()
    split = dict(split_experts(state.items()))
    assert not any(fused_expert_name(n) for n in split)
    assert sum(per_expert_name(n) is not None for n in split) == 2 * 3 * 3
    fused = dict(fuse_experts(split.items()))
    assert list(fused) == list(state)
    for name, tensor in state.items():
        assert torch.equal(fused[name], tensor), name
    # two layers' experts interleaved: with the expert count each module is emitted once complete
    layer = {i: [(n, t) for n, t in split.items() if n.startswith(f"model.layers.{i}.mlp.experts.")] for i in (0, 1)}
    interleaved = [kv for pair in zip(layer[0], layer[1]) for kv in pair]
    refused = dict(fuse_experts(interleaved, num_experts=3))
    assert sorted(refused) == sorted(n for n in state if fused_expert_name(n))
    assert all(torch.equal(t, state[n]) for n, t in refused.items())
    with pytest.raises(ValueError, match="missing"):
        list(fuse_experts(interleaved))  # without it a module counts as done when the stream moves on


def tiny_deepseek_v3(seed: int = 0):
    """A dense first layer, then a MoE layer of 4 routed experts and a shared expert (MLA attention)."""
    torch.manual_seed(seed)
    config = DeepseekV3Config(vocab_size=37, hidden_size=16, intermediate_size=24, moe_intermediate_size=6,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8,
                              q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, n_group=1,
                              topk_group=1)
    return AutoModelForCausalLM.from_config(config).float().eval()


@pytest.mark.parametrize("build", [tiny_qwen3_moe, tiny_deepseek_v3], ids=["qwen3_moe", "deepseek_v3"])
def test_split_matches_transformers_save_pretrained_and_its_load_fuses_back(tmp_path: Path, build):
    model = build()
    model.save_pretrained(tmp_path)  # transformers 5 reverts its conversion: per-expert tensors on disk
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {name: f.get_tensor(name) for name in f.keys()}
    ours = dict(split_experts((n, t.detach()) for n, t in model.state_dict().items()))
    assert set(ours) == set(saved)
    assert any(".mlp.experts.1.gate_proj.weight" in n for n in saved)  # the routed experts were split
    assert all(torch.equal(ours[n], saved[n]) for n in saved)
    assert checkpoint_expert_layout(tmp_path) == PER_EXPERT
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    refused = dict(fuse_experts(ours.items()))
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, refused[name]), name


def test_fuse_refuses_a_missing_or_repeated_expert_tensor():
    split = list(split_experts(tiny_qwen3_moe().state_dict().items()))
    gone = [(n, t) for n, t in split if n != "model.layers.1.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.1\.up_proj\.weight"):
        list(fuse_experts(gone))
    twice = split + [next((n, t) for n, t in split if n == "model.layers.1.mlp.experts.2.down_proj.weight")]
    with pytest.raises(ValueError, match="appears twice"):
        list(fuse_experts(sorted(twice, key=lambda kv: per_expert_name(kv[0]) is None)))


def test_layout_from_headers_or_index_only(tmp_path: Path):
    per_expert, fused, dense, indexed, mixed = (tmp_path / d for d in ("per", "fused", "dense", "index", "mixed"))
    for d in (per_expert, fused, dense, indexed, mixed):
        d.mkdir()
    t = torch.zeros(2, 2)
    save_file({"model.layers.0.mlp.experts.0.gate_proj.weight": t, "model.norm.weight": t.clone()},
              str(per_expert / "model.safetensors"))
    save_file({"model.layers.0.mlp.experts.gate_up_proj": t[None], "model.norm.weight": t.clone()},
              str(fused / "model-00001-of-00002.safetensors"))
    save_file({"model.layers.0.mlp.up_proj.weight": t}, str(dense / "model.safetensors"))
    # an index alone decides (its shards need not be read, nor even be present)
    (indexed / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.layers.5.mlp.experts.gate_up_proj": "model-00002-of-00002.safetensors"}}
    ))
    save_file({"a.mlp.experts.gate_up_proj": t[None], "a.mlp.experts.0.down_proj.weight": t.clone()},
              str(mixed / "model.safetensors"))
    assert checkpoint_expert_layout(per_expert) == PER_EXPERT
    assert checkpoint_expert_layout(fused) == FUSED
    assert checkpoint_expert_layout(dense) is None
    assert checkpoint_expert_layout(indexed) == FUSED
    assert checkpoint_expert_layout(tmp_path / "nothing-here") is None
    with pytest.raises(ValueError, match="both fused"):
        checkpoint_expert_layout(mixed)

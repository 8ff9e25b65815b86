"""The export of a mixture-of-experts model writes its experts in the layout of the checkpoint it started from
(flashdapo/trainer/state/export.py `in_source_expert_layout`): per-expert tensors for a per-expert source (the
Hub's Qwen3-MoE), fused ones for a fused source (transformers 5's own names), config unchanged, and
`from_pretrained` of the export gives back the trained weights exactly. Wall budget: 20 s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from flashdapo.config import ToyTaskConfig
from flashdapo.models.moe.expert_layout import FUSED, PER_EXPERT, checkpoint_expert_layout, split_experts
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.tasks.toy import build_toy_tokenizer
from flashdapo.trainer.state.export import export_hf


def _source(path: Path, layout: str):
    """A tiny Qwen3-MoE directory (3 experts, odd sizes) whose safetensors are written directly in `layout`."""
    tokenizer = build_toy_tokenizer(ToyTaskConfig())
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=12, intermediate_size=20, moe_intermediate_size=5,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=6,
                            num_experts=3, num_experts_per_tok=2, tie_word_embeddings=False,
                            architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(0)
    state = {n: t.detach().clone() for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if layout == PER_EXPERT:
        state = {n: t.clone() for n, t in split_experts(state.items())}
    path.mkdir()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer, set(state)


def _names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("layout", [PER_EXPERT, FUSED])
def test_the_export_keeps_the_sources_expert_layout_and_reloads_exactly(tmp_path, layout):
    source = tmp_path / "source"
    tokenizer, source_names = _source(source, layout)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():  # "trained": every expert moves, each its own way
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    trained = {n: t.detach().clone() for n, t in model.state_dict().items()}
    out = tmp_path / "export"
    export_hf(iter_full_state_dict(model), model.config, tokenizer, out, True, step=2, source_dir=source)
    assert checkpoint_expert_layout(out) == layout
    assert _names(out) == source_names
    exported = json.loads((out / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    written = ("transformers_version", "dtype")  # the export states the dtype its tensors are in
    assert {k: v for k, v in exported.items() if k not in written} == \
        {k: v for k, v in original.items() if k not in written}
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert list(reloaded) == list(trained)
    for name, tensor in trained.items():
        assert torch.equal(reloaded[name], tensor), name


def test_without_a_source_directory_the_export_is_the_models_own_fused_layout(tmp_path):
    tokenizer, _ = _source(tmp_path / "source", PER_EXPERT)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", dtype=torch.float32)
    model.config.name_or_path = ""  # a model built in memory (the toy) has no source
    export_hf(iter_full_state_dict(model), model.config, tokenizer, tmp_path / "export", True,
              source_dir=tmp_path / "nowhere")
    assert checkpoint_expert_layout(tmp_path / "export") == FUSED

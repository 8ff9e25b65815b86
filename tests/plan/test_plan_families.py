"""`flashdapo plan` for every family the trainer accepts (tests/helpers/family_configs.py, the family matrix's
rows): the plan of a config.json of each builds its meta model, reads its shape and plans a launch; Gemma 4's
per-layer attention (its full-attention layers: key/value heads and a head dim of their own) is read layer by
layer for the KV cache and checked for sequence parallelism."""

from __future__ import annotations

import json

import pytest

from flashdapo.__main__ import main
from flashdapo.config import toy
from flashdapo.plan.engine import kv_bytes_per_token
from flashdapo.plan.model import build_meta_model, model_shape
from flashdapo.plan.shapes import ModelSource
from tests.helpers.family_configs import MATRIX, family_config


def _config_json(tmp_path, model_type: str, **overrides) -> str:
    path = tmp_path / f"{model_type}.json"
    overrides.setdefault("max_position_embeddings", 4096)  # the toy preset asks for 2,058 positions
    path.write_text(json.dumps(family_config(model_type, **overrides).to_dict()))
    return str(path)


@pytest.mark.parametrize("model_type", MATRIX)
def test_every_family_plans(model_type, tmp_path, capsys):
    status = main(["plan", "--model-config", _config_json(tmp_path, model_type), "--nodes", "1",
                   "--gpus-per-node", "2"])
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    assert "memory per GPU" in out and "step time, modelled" in out, out


def test_gemma4s_kv_cache_counts_each_layers_heads_and_head_dim(tmp_path):
    """4 layers, full attention every second one (1 KV head of 16 there, 2 of 8 on sliding layers: the matrix's
    config with a wider global head): bf16 K and V summed layer by layer."""
    config = family_config("gemma4_text", layers=4, num_global_key_value_heads=1, attention_k_eq_v=True).to_dict()
    shape = model_shape(build_meta_model(ModelSource(config, "gemma4"), toy()), "gemma4")
    layers = [(1, 16) if kind == "full_attention" else (2, 8) for kind in config["layer_types"]]
    assert list(shape.layer_kv) == layers and "full_attention" in config["layer_types"]
    assert kv_bytes_per_token(shape, tp=1) == sum(2 * kv * dim * 2 for kv, dim in layers)
    assert kv_bytes_per_token(shape, tp=2) == sum(2 * max(1, kv // 2) * dim * 2 for kv, dim in layers)


def test_sequence_parallel_is_checked_against_gemma4s_full_attention_heads(tmp_path, capsys):
    path = _config_json(tmp_path, "gemma4_text", num_attention_heads=6, num_key_value_heads=2,
                        num_global_key_value_heads=3, attention_k_eq_v=True)
    status = main(["plan", "--model-config", path, "--trainer.sequence-parallel", "2", "--nodes", "1",
                   "--gpus-per-node", "2"])
    err = capsys.readouterr().err
    assert status == 1 and err.count("\n") == 1 and "6 query heads and 3 key/value heads (2 kinds of attention layer: 6/2, 6/3" in err, err

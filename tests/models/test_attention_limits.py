"""flash-attn's head-dim limit (flashdapo/models/attention_limits.py): Gemma 4's global layers (global_head_dim
512 in the released models) with model.attn_implementation flash_attention_2 are refused at start-up in one
line naming the field and the layer head dim, from config.json alone (no weights): by training's start
(trainer/builders.py checked_tokenizer), by the packed attention's switch (models/packing.py), in both
spellings of the field (the released config.json's global_head_dim; transformers 5's per-layer override)."""

import json

import pytest

from flashdapo.config import merge, toy
from flashdapo.errors import ConfigError
from flashdapo.models.attention_limits import (
    FLASH_MAX_HEAD_DIM,
    check_flash_attention,
    flash_attention_refusal,
)
from flashdapo.trainer import builders
from tests.helpers.family_configs import family_config


def _released_style(global_head_dim: int) -> dict:
    """A tiny gemma4_text config.json as the released models spell it: global_head_dim beside head_dim."""
    config = json.loads(family_config("gemma4_text").to_json_string(use_diff=False))
    config.pop("per_layer_config", None)
    return {**config, "global_head_dim": global_head_dim}


def test_gemma4_global_heads_wider_than_flash_attn_takes_are_refused_in_one_line():
    assert FLASH_MAX_HEAD_DIM == 256
    config = _released_style(512)
    with pytest.raises(ConfigError) as err:
        check_flash_attention(config, "flash_attention_2", "model.path=/m")
    message = str(err.value)
    assert message == ("model.attn_implementation=flash_attention_2: gemma4_text at model.path=/m: global_head_dim "
                       "512: a layer head dim above flash-attn's limit of 256; use --model.attn-implementation sdpa")
    for implementation in ("sdpa", "eager", "auto"):
        assert flash_attention_refusal(config, implementation) is None
    assert flash_attention_refusal(_released_style(256), "flash_attention_2") is None
    # transformers 5 writes the wider layers' head dim as a per-layer override; the config object too
    written = family_config("gemma4_text", global_head_dim=512)
    assert "per_layer_config[1].head_dim (layer 1) 512" in flash_attention_refusal(written, "flash_attention_2")
    assert flash_attention_refusal(family_config("gemma4_text"), "flash_attention_2") is None  # 16: fine
    assert flash_attention_refusal(family_config("qwen3"), "flash_attention_2") is None


def test_training_start_refuses_it_before_any_weights_load(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(_released_style(512)))
    monkeypatch.setattr(builders, "check_model_dir", lambda _path: None)  # no weights here: not the point

    def loaded(*_args, **_kwargs):
        raise AssertionError("the tokenizer and model checks ran first")

    monkeypatch.setattr(builders, "check_model", loaded)
    cfg = merge(toy(), {"model": {"path": str(tmp_path), "attn_implementation": "flash_attention_2"}})
    with pytest.raises(ConfigError, match=r"global_head_dim 512: a layer head dim above flash-attn's limit of 256"):
        builders.checked_tokenizer(cfg, print)


def test_the_packed_attention_switch_refuses_it_too():
    from transformers import AutoModelForCausalLM

    from flashdapo.models.packing import use_packed_attention

    model = AutoModelForCausalLM.from_config(family_config("gemma4_text", global_head_dim=512),
                                             attn_implementation="eager")
    model.config._attn_implementation = "flash_attention_2"  # as from_pretrained would set it on a GPU
    with pytest.raises(ConfigError, match=r"head dim above flash-attn's limit of 256"):
        use_packed_attention(model)

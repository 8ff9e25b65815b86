"""The config tree, presets and the CLI derived from them."""

import dataclasses

import pytest
import yaml

from flashdapo.__main__ import main as cli
from flashdapo.config import Config, ConfigError, load_file, merge, preset


def _leaf_fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            yield from _leaf_fields(f.default_factory, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_32b_preset_is_the_released_recipe():
    c = preset("qwen2.5-32b-dapo")
    assert (c.optim.lr, c.optim.betas, c.optim.weight_decay, c.optim.grad_clip, c.optim.warmup_steps) == \
        (1e-6, (0.9, 0.999), 0.1, 1.0, 10)
    assert (c.trainer.train_batch, c.trainer.gen_batch, c.rollout.n, c.trainer.mini_batch, c.trainer.ppo_epochs) == \
        (512, 1536, 16, 32, 1)
    assert c.trainer.train_batch // c.trainer.mini_batch == 16  # optimizer steps per training step
    assert (c.data.max_prompt_length, c.data.truncation, c.rollout.max_response_length) == (2048, "left", 20480)
    assert (c.rollout.temperature, c.rollout.top_p, c.rollout.top_k) == (1.0, 1.0, -1)
    assert (c.rollout.val_n, c.rollout.val_temperature, c.rollout.val_top_p) == (32, 1.0, 0.7)
    assert (c.algorithm.clip_low, c.algorithm.clip_high, c.algorithm.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert (c.algorithm.overlong_buffer_len, c.algorithm.overlong_penalty_factor, c.algorithm.overlong_filter) == \
        (4096, 1.0, False)
    assert (c.algorithm.max_gen_batches, c.algorithm.on_max_gen_batches) == (10, "error")
    assert (c.rollout.tensor_parallel_size, c.rollout.gpu_memory_utilization) == (4, 0.7)
    assert (c.trainer.micro_batch_tokens, c.trainer.val_every, c.checkpoint.save_every) == (22528, 5, 5)
    assert c.trainer.fsdp_cpu_offload


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit):
        cli(["train", "--help"])
    text = capsys.readouterr().out
    for name in _leaf_fields(Config):
        assert "--" + name.replace("_", "-") in text, name


def test_config_print_round_trips_through_a_file(tmp_path, capsys):
    assert cli(["config", "--preset", "qwen2.5-7b-math", "--trainer.total-steps", "7"]) == 0
    path = tmp_path / "c.yaml"
    path.write_text(capsys.readouterr().out)
    loaded = load_file(path, preset("toy"))
    expected = merge(preset("qwen2.5-7b-math"), {"trainer": {"total_steps": 7}})
    assert loaded == expected


def test_bad_values_name_the_field(tmp_path, capsys):
    assert cli(["config", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"total_stepz": 3}}))
    with pytest.raises(ConfigError, match=r"trainer\.: unknown key\(s\) \['total_stepz'\]"):
        load_file(path, preset("toy"))
    with pytest.raises(ConfigError, match="algorithm.overlong_buffer_len"):
        merge(preset("toy"), {"algorithm": {"overlong_buffer_len": 100}})
    with pytest.raises(ConfigError, match="rollout.engine"):
        merge(preset("toy"), {"rollout": {"engine": "vllm"}})
    with pytest.raises(ConfigError, match="cannot read"):
        load_file(tmp_path / "missing.yaml", preset("toy"))

"""The config tree, presets and the CLI derived from them."""

import dataclasses
import re

import pytest
import yaml

from flashdapo.__main__ import main as cli
from flashdapo.config import (
    PRESETS,
    AlgorithmConfig,
    Config,
    ConfigError,
    RolloutConfig,
    ToyTaskConfig,
    TrainerConfig,
    compact_summary,
    field_path,
    load_file,
    merge,
    preset,
)


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
    with pytest.raises(ConfigError, match=r"bad.yaml: trainer: unknown key\(s\) \['total_stepz'\]"):
        load_file(path, preset("toy"))
    with pytest.raises(ConfigError, match="algorithm.overlong_buffer_len"):
        merge(preset("toy"), {"algorithm": {"overlong_buffer_len": 100}})
    with pytest.raises(ConfigError, match="rollout.engine"):
        merge(preset("toy"), {"rollout": {"engine": "vllm"}})
    with pytest.raises(ConfigError, match="cannot read"):
        load_file(tmp_path / "missing.yaml", preset("toy"))


# A config file is checked as strictly as the command line: each case names the file, the field and what
# was expected, in one line.
YAML_CASES = [
    ("trainer: 5", "trainer: expected a mapping (a config section), got int 5"),
    ("logging: null", "logging: expected a mapping (a config section), got null"),
    ("trainer: {val_before_train: 'false'}", "trainer.val_before_train: expected true or false, got 'false'"),
    ("trainer: {total_steps: ten}", "trainer.total_steps: expected an integer, got 'ten'"),
    ("trainer: {total_steps: 2.5}", "trainer.total_steps: expected an integer, got 2.5"),
    ("model: {toy: {sft_steps: true}}", "model.toy.sft_steps: expected an integer, got True"),
    ("optim: {betas: 0.9}", "optim.betas: expected a list of 2 finite numbers, got 0.9"),
    ("optim: {betas: [0.9, 0.99, 0.999]}", "optim.betas: expected a list of 2 finite numbers"),
    ("optim: {lr: .inf}", "optim.lr: expected a finite number, got inf"),
    ("optim: {eps: -1}", "optim.eps: expected > 0, got -1.0"),
    ("optim: {grad_clip: .nan}", "optim.grad_clip: expected a finite number, got nan"),
    ("algorithm: {clip_high: .inf}", "algorithm.clip_high: expected a finite number, got inf"),
    ("algorithm: {clip_ratio_c: 'off'}", "algorithm.clip_ratio_c: expected null or a finite number, got 'off'"),
    ("rollout: {engine: tpu}", "rollout.engine: expected one of 'torch', 'vllm', got 'tpu'"),
    ("rollout: {sleep_level: true}", "rollout.sleep_level: expected one of 1, 2, got True"),
    ("checkpoint: {keep_last: null}", "checkpoint.keep_last: expected an integer, got null"),
    ("data: {train_files: a.jsonl}", "data.train_files: expected a list of strings, got 'a.jsonl'"),
    ("trainer: {total_steps: 3\n  bad", "not valid YAML/JSON at line"),
    ("optim:\n  lr: 1.0e-5\ntrainer:\n  seed: 1\noptim:\n  lr: 2.0e-5\n",
     "line 5: key 'optim' appears twice (first at line 1); keep one"),
    ("optim:\n  lr: 1.0e-5\n  eps: 1.0e-8\n  lr: 2.0e-5\n", "line 4: key 'lr' appears twice (first at line 2); keep one"),
    ('{"trainer": {"seed": 1, "seed": 2}}', "line 1: key 'seed' appears twice"),
]


@pytest.mark.parametrize(("text", "message"), YAML_CASES)
def test_config_file_types_are_strict(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_file(path, preset("toy"))
    assert str(err.value).startswith(f"--config {path}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_config_file_must_be_utf8(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("logging: {run_dir: caf\u00e9}".encode("latin-1"))
    assert cli(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"flashdapo: config error: --config {path}: not UTF-8 text (byte 0xe9 at offset 22)\n"


def test_config_file_numbers_read_as_the_command_line_reads_them(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim: {lr: 1e-6, betas: [0, 0.99], grad_clip: 2}\n")  # YAML 1.1 reads 1e-6 as a string
    optim = load_file(path, preset("toy")).optim
    assert (optim.lr, optim.betas, optim.grad_clip) == (1e-6, (0.0, 0.99), 2.0)
    assert type(optim.grad_clip) is float and type(optim.betas) is tuple


@pytest.mark.parametrize(("flag", "value", "field"), [
    ("--optim.lr", "inf", "optim.lr"), ("--optim.eps", "-1", "optim.eps"),
    ("--algorithm.clip-high", "inf", "algorithm.clip_high"), ("--optim.grad-clip", "nan", "optim.grad_clip"),
    ("--algorithm.overlong-penalty-factor", "inf", "algorithm.overlong_penalty_factor"),
    ("--rollout.temperature", "nan", "rollout.temperature"), ("--model.toy.sft-lr", "-inf", "model.toy.sft_lr"),
    ("--algorithm.advantage-eps", "0", "algorithm.advantage_eps"),
])
def test_command_line_rejects_non_finite_and_out_of_range(capsys, flag, value, field):
    assert cli(["config", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flashdapo: config error: {field}: expected ") and err.count("\n") == 1


def _nested(path, value):
    head, _, rest = path.partition(".")
    return {head: _nested(rest, value) if rest else value}


@pytest.mark.parametrize("name", list(_leaf_fields(Config)))
def test_every_field_is_type_checked_under_its_path(name):
    with pytest.raises(ConfigError, match=rf"^{re.escape(name)}: expected .*, got <object"):
        merge(preset("toy"), _nested(name, object()))


def test_paths_are_derived_from_the_tree():
    assert field_path(ToyTaskConfig, "num_val") == "data.toy.num_val"
    with pytest.raises(ConfigError, match=r"^data\.toy\.max_operand: expected >= 1, got 0$"):
        ToyTaskConfig(max_operand=0)


def test_section_checks_name_the_field():
    with pytest.raises(ConfigError, match="trainer.mini_batch"):
        TrainerConfig(train_batch=10, mini_batch=3)
    with pytest.raises(ConfigError, match=r"rollout.top_p: expected a value in \(0, 1\]"):
        RolloutConfig(top_p=0.0)
    with pytest.raises(ConfigError, match="algorithm.clip_ratio_c"):
        AlgorithmConfig(clip_ratio_c=0.5)


def test_dynamic_sampling_off_needs_gen_batch_equal_to_train_batch():
    # Every generated group trains: a larger generation batch would be thrown away.
    with pytest.raises(ConfigError, match=r"^trainer\.gen_batch: expected trainer\.train_batch \(512\) when "
                                          r"algorithm\.dynamic_sampling is false, got 1536$"):
        merge(Config(), {"algorithm": {"dynamic_sampling": False}})
    cfg = merge(Config(), {"algorithm": {"dynamic_sampling": False}, "trainer": {"gen_batch": 512}})
    assert cfg.trainer.gen_batch == cfg.trainer.train_batch == 512


def _differences(overrides, defaults, prefix=""):
    for name, value in overrides.items():
        if isinstance(value, dict):
            yield from _differences(value, getattr(defaults, name), f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value, getattr(defaults, name)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_state_only_what_differs_from_the_defaults(name):
    for path, value, default in _differences(PRESETS[name], Config()):
        assert value != default and not (isinstance(default, tuple) and tuple(value) == default), (name, path)


def _bool_fields(cls=Config, prefix=""):
    from flashdapo.config.checks import field_spec, section_type

    for f in dataclasses.fields(cls):
        sub = section_type(cls, f.name)
        if sub is not None:
            yield from _bool_fields(sub, f"{prefix}{f.name}.")
        elif field_spec(cls, f.name)[0] is bool:
            yield f"{prefix}{f.name}"


@pytest.mark.parametrize(("word", "value"), [("true", True), ("false", False), ("True", True), ("False", False),
                                             ("1", True), ("0", False), ("TRUE", True)])
def test_every_bool_field_takes_the_words_the_docs_write(word, value, capsys):
    names = list(_bool_fields())
    assert len(names) > 10 and "logging.move_old_run" in names
    args = [a for name in names for a in ("--" + name.replace("_", "-"), word)]
    args += ["--trainer.gen-batch", "32"] if not value else []  # dynamic_sampling false needs gen == train batch
    assert cli(["config", *args]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    for name in names:
        section, *rest = name.split(".")
        leaf = printed[section]
        for part in rest:
            leaf = leaf[part]
        assert leaf is value, name


def test_a_bool_flag_refuses_other_words(capsys):
    with pytest.raises(SystemExit):
        cli(["config", "--logging.move-old-run", "yes"])
    assert "invalid choice 'yes'" in capsys.readouterr().err


def test_version(capsys):
    import flashdapo

    assert cli(["--version"]) == 0 and capsys.readouterr().out == f"flashdapo {flashdapo.__version__}\n"


def test_compact_summary_is_one_line_per_changed_section():
    lines = compact_summary(merge(preset("toy"), {"data": {"train_files": ["a.jsonl", "b.jsonl"]}}))
    assert lines[0] == "data: train_files=a.jsonl,b.jsonl"
    assert "optim: lr=0.0005 weight_decay=0.0 warmup_steps=2" in lines and len(lines) == len(PRESETS["toy"]) + 1
    assert compact_summary(Config()) == []

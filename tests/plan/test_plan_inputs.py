"""`flashdapo plan`'s inputs are checked as `flashdapo train`'s are: nodes and GPUs per node at least 1 (left out:
the preset's cluster, said in a note), the MFU in (0, 1], and a --model-config (or model.path's config.json) the
model can be built from, one line naming the file and the field; the same model checks refuse it for train
(preflight.check_model_config / check_model). Split placement's rollout ranks cannot be profiled."""

from __future__ import annotations

import json

import pytest

from flashdapo.__main__ import main
from flashdapo.config import ConfigError, merge, toy
from flashdapo.models.model_dir import ModelDirError
from flashdapo.plan.shapes import builtin_shape
from flashdapo.preflight import check_launch, check_model, check_model_config
from tests.helpers.model_dirs import model_dir

SMALL = ["--trainer.train-batch", "8", "--trainer.gen-batch", "8", "--trainer.mini-batch", "8"]


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["plan", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize(("flags", "field"), [
    (["--nodes", "0"], "plan.nodes"), (["--nodes", "-1"], "plan.nodes"), (["--gpus-per-node", "0"], "plan.gpus_per_node"),
    (["--mfu", "0"], "plan.mfu"), (["--mfu", "nan"], "plan.mfu"), (["--mfu", "1.5"], "plan.mfu"),
])
def test_a_cluster_or_an_mfu_that_means_nothing_is_refused(flags, field, capsys):
    status, out, err = _plan(capsys, *flags)
    assert status == 2 and out == "" and err.startswith(f"flashdapo: config error: {field}: expected ") and \
        err.count("\n") == 1, err
    if "nodes" in field or "gpus" in field:
        assert "leave it out for the preset's first documented cluster" in err


def test_the_presets_cluster_is_taken_only_when_left_out_and_the_plan_says_so(capsys):
    status, out, _ = _plan(capsys, "--preset", "qwen2.5-32b-dapo")
    assert status == 0 and "16 node(s) x 8 H20 = 128 ranks" in out
    assert ("note: --nodes and --gpus-per-node not given: 16 node(s) x 8 GPU(s), the first documented cluster of "
            "preset 'qwen2.5-32b-dapo'") in out
    status, out, _ = _plan(capsys, "--preset", "qwen2.5-32b-dapo", "--nodes", "8")
    assert status == 0 and "8 node(s) x 8 H20 = 64 ranks" in out and "note: --gpus-per-node not given" in out
    status, out, _ = _plan(capsys, "--preset", "qwen2.5-32b-dapo", "--nodes", "16", "--gpus-per-node", "8")
    assert status == 0 and "not given" not in out
    assert main(["plan", "--help"]) == 0
    assert "--nodes (default None): Nodes (torchrun --nnodes); not given (None): the preset's first documented " \
           "cluster's" in capsys.readouterr().out


def _config(**changes) -> dict:
    values = builtin_shape("Qwen2.5-0.5B")
    for key, value in changes.items():
        if value is ...:
            del values[key]
        else:
            values[key] = value
    return values


CASES = {
    "malformed": ("{bad", "not valid JSON at line 1, column 2"),
    "a list": ("[1, 2]", "expected a JSON object (a model's config.json), got list"),
    "a string hidden size": (_config(hidden_size="896"), "hidden_size: expected a positive integer, got '896'"),
    "zero heads": (_config(num_attention_heads=0), "num_attention_heads: expected a positive integer, got 0"),
    "vocabulary 0": (_config(vocab_size=0), "vocab_size: expected a positive integer, got 0"),
    "negative layers": (_config(num_hidden_layers=-1), "num_hidden_layers: expected a positive integer, got -1"),
    "a bool width": (_config(intermediate_size=True), "intermediate_size: expected a positive integer, got True"),
    "no vocabulary": (_config(vocab_size=...), "vocab_size: expected a positive integer, got None (missing)"),
    "heads not dividing hidden": (_config(num_attention_heads=6, num_key_value_heads=1),
                                  "num_attention_heads: 6 does not divide hidden_size 896"),
    "KV heads not dividing heads": (_config(num_key_value_heads=3),
                                    "num_key_value_heads: 3 does not divide num_attention_heads 14"),
    "an unknown architecture": (_config(model_type="gpt_neo"), "model_type 'gpt_neo'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_config_the_model_cannot_be_built_from_is_one_line_naming_file_and_field(case, tmp_path, capsys):
    content, expected = CASES[case]
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    status, out, err = _plan(capsys, "--model-config", str(path), *SMALL, "--nodes", "1", "--gpus-per-node", "1")
    assert status == 1 and out == "", err
    assert err.startswith("flashdapo plan: cannot launch: ") and err.count("\n") == 1, err
    assert str(path) in err and expected in err, err


def test_model_paths_config_json_is_read_the_same_way(tmp_path, capsys):
    model = model_dir(tmp_path / "m")
    capsys.readouterr()  # saving the model printed a progress bar
    (model / "config.json").write_text("{\"model_type\": ")
    status, _, err = _plan(capsys, "--model.path", str(model), "--data.train-files", str(tmp_path / "d.jsonl"),
                           *SMALL, "--nodes", "1", "--gpus-per-node", "1")
    assert status == 1 and err.count("\n") == 1 and f"model.path: {model / 'config.json'}: not valid JSON" in err, err


@pytest.mark.parametrize("case", [c for c in CASES if c not in ("malformed", "an unknown architecture")])
def test_train_checks_the_same_fields(case):
    """What train runs on config.json before the weights load (preflight.check_model_config)."""
    content = CASES[case][0]
    config = json.loads(content) if isinstance(content, str) else content
    with pytest.raises(ModelDirError) as refused:
        check_model_config(config, "model.path=/m", 64, "data.max_prompt_length + rollout.max_response_length",
                           named="/m/config.json")
    assert f"/m/config.json: {CASES[case][1]}" in str(refused.value)


def test_train_refuses_a_string_width_in_one_line_before_the_weights_load(tmp_path):
    model = model_dir(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": "16"}))
    with pytest.raises(ModelDirError, match=r"config.json: hidden_size: expected a positive integer, got '16'"):
        check_model(str(model), "model.path", 32, "data.max_prompt_length + rollout.max_response_length")


def test_profiling_a_rollout_rank_of_split_placement_is_refused_at_start(capsys):
    cfg = merge(toy(), {"rollout": {"placement": "split", "rollout_ranks": 1},
                        "profile": {"steps": [1], "ranks": [1]}})
    with pytest.raises(ConfigError, match=r"profile.ranks: rank 1 is a rollout rank under rollout.placement=split "
                                          r"\(ranks 1..1 generate"):
        check_launch(cfg, world_size=2)
    check_launch(merge(cfg, {"profile": {"ranks": [0]}}), world_size=2)  # a trainer rank: fine
    status, _, err = _plan(capsys, "--rollout.placement", "split", "--rollout.rollout-ranks", "1",
                           "--profile.steps", "1", "--profile.ranks", "1", "--nodes", "1", "--gpus-per-node", "2")
    assert status == 1 and "profile.ranks: rank 1 is a rollout rank" in err and err.count("\n") == 1, err

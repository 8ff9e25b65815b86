"""`~` in a path field is the user's home, wherever the value comes from (command line, config file, code):
model.path, the data files, run_dir, checkpoint.resume, profile.dir, and the path options of plan, ablate,
eval and generate. One place does it (config/checks.py IS_PATH, expanded when a section is built)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from flashdapo.__main__ import main
from flashdapo.config import Config, ModelConfig, merge, toy
from flashdapo.config.checks import is_path_field
from flashdapo.config.cli import resolve_config


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_every_path_field_of_the_tree_expands_the_home(home):
    cfg = resolve_config(["--model.path", "~/models/q", "--data.train-files", "~/d/a.jsonl", "~/d/b.parquet",
                          "--data.val-files", "~/d/v.jsonl", "--logging.run-dir", "~/runs/x",
                          "--checkpoint.resume", "~/runs/x/checkpoints/step_00000002", "--profile.dir", "~/prof"],
                         "flashdapo config")
    assert cfg.model.path == f"{home}/models/q"
    assert cfg.data.train_files == [f"{home}/d/a.jsonl", f"{home}/d/b.parquet"]
    assert cfg.data.val_files == [f"{home}/d/v.jsonl"]
    assert cfg.logging.run_dir == f"{home}/runs/x"
    assert cfg.checkpoint.resume == f"{home}/runs/x/checkpoints/step_00000002"
    assert cfg.profile.dir == f"{home}/prof"
    # 'auto' and relative paths stay as written.
    cfg = merge(toy(), {"checkpoint": {"resume": "auto"}, "logging": {"run_dir": "runs/y"}})
    assert (cfg.checkpoint.resume, cfg.logging.run_dir) == ("auto", "runs/y")


def test_a_config_file_and_code_expand_it_too(home):
    path = home / "c.yaml"
    path.write_text("model:\n  path: ~/models/q\nlogging:\n  run_dir: ~/runs/z\n")
    assert main(["config", "--config", str(path)]) == 0
    assert ModelConfig(path="~/m").path == f"{home}/m"
    cfg = dataclasses.replace(Config(), model=dataclasses.replace(Config().model, path="~/n"))
    assert cfg.model.path == f"{home}/n"


def test_the_printed_config_holds_the_expanded_path(home, capsys):
    assert main(["config", "--model.path", "~/models/q", "--data.train-files", "~/d.jsonl"]) == 0
    out = capsys.readouterr().out
    assert f"path: {home}/models/q" in out and f"- {home}/d.jsonl" in out and "~" not in out


def test_the_fields_marked_as_paths():
    marked = {f"{section}.{f.name}" for section in ("model", "data", "checkpoint", "logging", "profile")
              for f in dataclasses.fields(getattr(Config(), section))
              if is_path_field(type(getattr(Config(), section)), f.name)}
    assert marked == {"model.path", "data.train_files", "data.val_files", "checkpoint.resume", "logging.run_dir",
                      "profile.dir"}


def test_the_other_commands_path_options(home, capsys):
    from flashdapo.ablation.command import parse_ablate_command
    from flashdapo.eval.command import eval_args_class
    from flashdapo.eval.generate import generate_args_class
    from flashdapo.plan.command import parse_plan_args

    assert parse_ablate_command(["--out", "~/abl"])[0].out == f"{home}/abl"
    assert parse_plan_args(["--model-config", "~/config.json"])[0].model_config == f"{home}/config.json"
    (home / "model").mkdir()
    (home / "d.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    args = eval_args_class(Config())(model="~/model", data=["~/d.jsonl"], out="~/out")
    assert (args.model, args.data, args.out) == (f"{home}/model", [f"{home}/d.jsonl"], f"{home}/out")
    args = generate_args_class(Config())(model="~/model", data="~/d.jsonl", out="~/g.jsonl")
    assert (args.model, args.data, args.out) == (f"{home}/model", f"{home}/d.jsonl", f"{home}/g.jsonl")
    assert os.path.expanduser("~") == str(home)

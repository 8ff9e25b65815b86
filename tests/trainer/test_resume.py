"""Honest resume: a resume with settings that would splice two runs is refused naming each field old -> new,
an accepted change (checkpoint.allow_changes) really applies (the learning rate), an unchanged resume
reproduces the uninterrupted run bit for bit, another run's checkpoints are never adopted while a damaged one
is skipped for the one before it, and each start keeps its own config file. Single process, the tiny toy run (seconds)."""

import dataclasses
import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from flashdapo.config import ToyTaskConfig, merge
from flashdapo.tasks.toy import build_toy_tokenizer, toy_records
from flashdapo.trainer.loop import train
from flashdapo.trainer.run_settings import ResumeRefused, file_sha256

from .test_loop import _write_aime_style_parquet, tiny_config

QUICK = {"trainer": {"total_steps": 2, "val_before_train": False, "val_every": 0},
         "checkpoint": {"save_every": 1, "keep_last": 3}, "logging": {"plot": False}}


def _config(run_dir, **overrides):
    cfg = tiny_config(run_dir, **QUICK)
    return merge(cfg, overrides) if overrides else cfg


def _resume(run_dir, **overrides):
    cfg = _config(run_dir, checkpoint={"resume": "auto"})
    return merge(cfg, overrides) if overrides else cfg


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run (checkpoints at steps 1 and 2); tests copy it before resuming."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(_config(run_dir))
    return run_dir


@pytest.fixture
def run_dir(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy, ignore=shutil.ignore_patterns(".flashdapo.lock"))
    return copy


@pytest.mark.parametrize("overrides, expected", [
    ({"optim": {"lr": 2e-3}}, "optim.lr 0.0005 -> 0.002"),
    ({"trainer": {"train_batch": 8, "gen_batch": 8}}, "trainer.train_batch 4 -> 8; trainer.gen_batch 4 -> 8"),
    ({"rollout": {"n": 2}}, "rollout.n 4 -> 2"),
    ({"algorithm": {"clip_high": 0.3}}, "algorithm.clip_high 0.28 -> 0.3"),
    ({"data": {"toy": {"ops": "+-"}}}, "data.toy.ops + -> +-"),
])
def test_a_resume_with_changed_settings_is_refused_naming_each_field(run_dir, overrides, expected):
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(ResumeRefused) as info:
        train(_resume(run_dir, **overrides))
    message = str(info.value)
    assert "\n" not in message and expected in message and "step_00000002" in message, message
    assert "--checkpoint.allow-changes " + " ".join(part.split()[0] for part in expected.split("; ")) in message
    assert (run_dir / "metrics.jsonl").read_text() == before and not list(run_dir.glob("config.resume-*"))


def test_an_accepted_lr_change_is_the_rate_the_resumed_run_trains_at(run_dir, capsys):
    new_lr = 2e-3
    run = train(_resume(run_dir, trainer={"total_steps": 3}, optim={"lr": new_lr},
                        checkpoint={"allow_changes": ["optim.lr"]}))
    out = capsys.readouterr().out
    assert "settings changed from the checkpoint's (checkpoint.allow_changes=optim.lr): optim.lr 0.0005 -> 0.002" in out
    warmup = max(run.cfg.optim.warmup_steps, 1)
    # The schedule's factor at step 3 (2 steps taken) times the NEW base rate, as the loop logged it and the
    # optimizer used it; after step 3 the optimizer holds the factor of 3 steps taken.
    assert _metrics(run_dir)[-1]["step"] == 3
    assert _metrics(run_dir)[-1]["actor/lr"] == pytest.approx(new_lr * min(1.0, 3 / warmup), rel=1e-12)
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(new_lr * min(1.0, 4 / warmup), rel=1e-12)
    assert run.scheduler.base_lrs == [new_lr]
    # The new rate is recorded as this run's setting: a second resume at it needs no override.
    train(_resume(run_dir, trainer={"total_steps": 4}, optim={"lr": new_lr}))
    # Each start kept its own config; run.json says what changed.
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["lr"] == 5e-4
    assert yaml.safe_load((run_dir / "config.resume-1.yaml").read_text())["optim"]["lr"] == new_lr
    assert (run_dir / "config.resume-2.yaml").is_file()
    starts = json.loads((run_dir / "run.json").read_text())["starts"]
    assert [s["step"] for s in starts] == [0, 2, 3]
    assert starts[1]["accepted_changes"] == {"optim.lr": [5e-4, new_lr]} and starts[2]["accepted_changes"] == {}


def test_an_unchanged_resume_reproduces_the_uninterrupted_run_bitwise(finished, tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    train(_config(uninterrupted, trainer={"total_steps": 3}))
    shutil.copytree(finished, tmp_path / "resumed", ignore=shutil.ignore_patterns(".flashdapo.lock"))
    resumed = tmp_path / "resumed"
    train(_resume(resumed, trainer={"total_steps": 3}, checkpoint={"resume": str(resumed / "checkpoints" /
                                                                                  "step_00000001")}))
    assert _metrics(resumed) == _metrics(uninterrupted)
    ours, theirs = (load_file(d / "export" / "model.safetensors") for d in (resumed, uninterrupted))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _truncate_every_file(checkpoint):
    for file in checkpoint.iterdir():
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _unparsable_marker(text):
    return lambda checkpoint: (checkpoint / "COMPLETE").write_text(text)


@pytest.mark.parametrize("damage, what, without_run_json", [
    (_truncate_every_file, "step_00000002/COMPLETE: does not parse", False),
    (_truncate_every_file, "step_00000002/COMPLETE: does not parse", True),  # the run adopted from step 1
    (_unparsable_marker("{not json"), "step_00000002/COMPLETE: does not parse", False),
    (_unparsable_marker('{"run_id": 7}'), "step_00000002/COMPLETE: not a checkpoint marker", False),
    (lambda checkpoint: (checkpoint / ".metadata").unlink(), "it is damaged (missing .metadata)", False),
], ids=["truncated", "truncated-no-run-json", "not-json", "not-a-marker", "missing-file"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before_it(finished, run_dir, capsys, damage, what,
                                                                       without_run_json):
    run_id = json.loads((finished / "run.json").read_text())["run_id"]
    damage(run_dir / "checkpoints" / "step_00000002")
    if without_run_json:
        (run_dir / "run.json").unlink()
    run = train(_resume(run_dir))
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if "skipping checkpoint step_00000002" in line]
    assert len(skipped) == 1 and what in skipped[0], out
    assert "belongs to run" not in out and "of another run" not in out
    assert run.start_step == 1 and run.run_id == run_id and f"resumed from {run_dir}/checkpoints/step_00000001" in out
    assert _metrics(run_dir) == _metrics(finished)  # step 2 retrained from step 1 as the first run trained it


def test_a_changed_train_file_with_the_same_rows_is_refused(tmp_path):
    records = toy_records(ToyTaskConfig(num_train=24, seed=3), "train")
    data = tmp_path / "train.parquet"
    _write_aime_style_parquet(data, records)
    run_dir = tmp_path / "run"
    train(_config(run_dir, data={"train_files": [str(data)]}, trainer={"total_steps": 1}))
    old_hash = file_sha256(data)
    changed = [dataclasses.replace(records[0], ground_truth=records[0].ground_truth + "0"), *records[1:]]
    _write_aime_style_parquet(data, changed)  # same row count, one answer changed
    with pytest.raises(ResumeRefused, match=rf"data.train_files \[\"sha256:{old_hash}\"\] -> \[\"sha256:"):
        train(_resume(run_dir, data={"train_files": [str(data)]}))


def _model_dir(path, cls, config_cls, tokenizer, **extra):
    config = config_cls(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                        tie_word_embeddings=True, **extra)
    torch.manual_seed(0)
    cls(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_resume_with_another_architecture_is_refused(tmp_path):
    tokenizer = build_toy_tokenizer(ToyTaskConfig())
    qwen = _model_dir(tmp_path / "qwen", Qwen2ForCausalLM, Qwen2Config, tokenizer)
    llama = _model_dir(tmp_path / "llama", LlamaForCausalLM, LlamaConfig, tokenizer)
    data = tmp_path / "train.parquet"
    _write_aime_style_parquet(data, toy_records(ToyTaskConfig(num_train=24), "train"))
    files = {"train_files": [str(data)]}
    run_dir = tmp_path / "run"
    train(_config(run_dir, model={"path": str(qwen)}, data=files, trainer={"total_steps": 1}))
    with pytest.raises(ResumeRefused, match=r"model.architecture Qwen2ForCausalLM -> LlamaForCausalLM; "
                                            r"model.config.model_type qwen2 -> llama.*model.parameters sha256:"):
        train(_resume(run_dir, model={"path": str(llama)}, data=files))
    with pytest.raises(ResumeRefused, match="'model.architecture' cannot be allowed"):
        train(_resume(run_dir, model={"path": str(llama)}, data=files,
                      checkpoint={"allow_changes": ["model.architecture"]}))


def test_another_runs_checkpoint_is_never_adopted(tmp_path, capsys):
    mine, other = tmp_path / "mine", tmp_path / "other"
    first = train(_config(mine, checkpoint={"save_every": 2}))  # checkpoint at step 2 only
    second = train(_config(other, trainer={"total_steps": 3, "seed": 1}))  # steps 1, 2, 3
    before = (mine / "metrics.jsonl").read_text()
    # Older than this run's newest: skipped with a warning; this run resumes.
    shutil.copytree(other / "checkpoints" / "step_00000001", mine / "checkpoints" / "step_00000001")
    run = train(_resume(mine))
    assert run.run_id == first.run_id and run.start_step == 2
    assert "skipping 1 checkpoint(s) of another run in checkpoints/ (step_00000001)" in capsys.readouterr().out
    # Newer: refused in one line, nothing touched.
    shutil.copytree(other / "checkpoints" / "step_00000003", mine / "checkpoints" / "step_00000003")
    with pytest.raises(ResumeRefused) as info:
        train(_resume(mine, trainer={"total_steps": 4}))
    message = str(info.value)
    assert "\n" not in message and f"belongs to run {second.run_id}" in message and first.run_id in message
    assert (mine / "metrics.jsonl").read_text() == before
    # Named by path from another run's directory: refused as well.
    with pytest.raises(ResumeRefused, match=f"belongs to run {second.run_id}"):
        train(_resume(mine, checkpoint={"resume": str(other / "checkpoints" / "step_00000002")}))
    # Behind a damaged newest checkpoint, the newest readable one is another run's: still refused.
    shutil.copytree(other / "checkpoints" / "step_00000003", mine / "checkpoints" / "step_00000004")
    (mine / "checkpoints" / "step_00000004" / "COMPLETE").write_text("{not json")
    with pytest.raises(ResumeRefused, match=f"newest checkpoint with a readable marker, .*step_00000003, belongs "
                                            f"to run {second.run_id}"):
        train(_resume(mine, trainer={"total_steps": 5}))
    assert (mine / "metrics.jsonl").read_text() == before

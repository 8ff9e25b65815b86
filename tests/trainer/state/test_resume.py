"""Honest resume: a resume with settings that would splice two runs is refused naming each field old -> new,
an accepted change (checkpoint.allow_changes) really applies (the learning rate), an unchanged resume
reproduces the uninterrupted run bit for bit, another run's checkpoints are never adopted while a damaged one
is skipped for the one before it, and each start keeps its own config file; a model config that computes
another function with the same weights (Gemma 3's final-logit softcap) is refused unless allowed, and a checkpoint
that predates those records resumes. Single process, the tiny toy run (seconds)."""

import dataclasses
import itertools
import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from flashdapo.config import ToyTaskConfig
from flashdapo.models.hf import final_logit_softcap
from flashdapo.tasks.toy import build_toy_tokenizer, toy_records
from flashdapo.trainer.loop import train
from flashdapo.trainer.state.run_settings import ResumeRefused, file_sha256
from tests.helpers.data_files import write_aime_style_parquet
from tests.helpers.model_dirs import model_dir
from tests.helpers.runs import quick_config, resume_config, run_metrics


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run (checkpoints at steps 1 and 2); tests copy it before resuming."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(quick_config(run_dir))
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
        train(resume_config(run_dir, **overrides))
    message = str(info.value)
    assert "\n" not in message and expected in message and "step_00000002" in message, message
    assert "--checkpoint.allow-changes " + " ".join(part.split()[0] for part in expected.split("; ")) in message
    assert (run_dir / "metrics.jsonl").read_text() == before and not list(run_dir.glob("config.resume-*"))


def test_an_accepted_lr_change_is_the_rate_the_resumed_run_trains_at(run_dir, capsys):
    new_lr = 2e-3
    run = train(resume_config(run_dir, trainer={"total_steps": 3}, optim={"lr": new_lr},
                        checkpoint={"allow_changes": ["optim.lr"]}))
    out = capsys.readouterr().out
    assert "settings changed from the checkpoint's (checkpoint.allow_changes=optim.lr): optim.lr 0.0005 -> 0.002" in out
    warmup = max(run.cfg.optim.warmup_steps, 1)
    # The schedule's factor at step 3 (2 steps taken) times the NEW base rate, as the loop logged it and the
    # optimizer used it; after step 3 the optimizer holds the factor of 3 steps taken.
    assert run_metrics(run_dir)[-1]["step"] == 3
    assert run_metrics(run_dir)[-1]["actor/lr"] == pytest.approx(new_lr * min(1.0, 3 / warmup), rel=1e-12)
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(new_lr * min(1.0, 4 / warmup), rel=1e-12)
    assert run.scheduler.base_lrs == [new_lr]
    # The new rate is recorded as this run's setting: a second resume at it needs no override.
    train(resume_config(run_dir, trainer={"total_steps": 4}, optim={"lr": new_lr}))
    # Each start kept its own config; run.json says what changed.
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["lr"] == 5e-4
    assert yaml.safe_load((run_dir / "config.resume-1.yaml").read_text())["optim"]["lr"] == new_lr
    assert (run_dir / "config.resume-2.yaml").is_file()
    starts = json.loads((run_dir / "run.json").read_text())["starts"]
    assert [s["step"] for s in starts] == [0, 2, 3]
    assert starts[1]["accepted_changes"] == {"optim.lr": [5e-4, new_lr]} and starts[2]["accepted_changes"] == {}


def test_an_unchanged_resume_reproduces_the_uninterrupted_run_bitwise(finished, tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    train(quick_config(uninterrupted, trainer={"total_steps": 3}))
    shutil.copytree(finished, tmp_path / "resumed", ignore=shutil.ignore_patterns(".flashdapo.lock"))
    resumed = tmp_path / "resumed"
    train(resume_config(resumed, trainer={"total_steps": 3}, checkpoint={"resume": str(resumed / "checkpoints" /
                                                                                  "step_00000001")}))
    assert run_metrics(resumed) == run_metrics(uninterrupted)
    ours, theirs = (load_file(d / "export" / "model.safetensors") for d in (resumed, uninterrupted))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_cumulative_counters_continue_across_a_resume(finished, tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    train(quick_config(uninterrupted, trainer={"total_steps": 3}, checkpoint={"export_hf": False}))
    shutil.copytree(finished, tmp_path / "resumed", ignore=shutil.ignore_patterns(".flashdapo.lock"))
    resumed = tmp_path / "resumed"
    state = torch.load(resumed / "checkpoints" / "step_00000001" / "trainer_state.pt", weights_only=True)
    train(resume_config(resumed, trainer={"total_steps": 3}, checkpoint={"export_hf": False, "resume": str(
        resumed / "checkpoints" / "step_00000001")}))
    keys = ("train/generated_samples_cum", "train/generated_tokens_cum")
    ours, theirs = ([{k: r[k] for k in keys} for r in run_metrics(d) if r["step"] > 0] for d in (resumed, uninterrupted))
    assert ours == theirs and len(ours) == 3
    # The running sums of the per-step counts, continued from the checkpoint's (not restarted at 0).
    steps = [r for r in run_metrics(uninterrupted) if r["step"] > 0]
    assert [r["train/generated_tokens_cum"] for r in steps] == list(
        itertools.accumulate(r["train/generated_tokens"] for r in steps))
    assert [r["train/generated_samples_cum"] for r in steps] == [4 * 4 * s for s in (1, 2, 3)]  # gen_batch x n
    assert state["totals"] == {"generated_samples": 16, "generated_tokens": steps[0]["train/generated_tokens"]}


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
    run = train(resume_config(run_dir))
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if "skipping checkpoint step_00000002" in line]
    assert len(skipped) == 1 and what in skipped[0], out
    assert "belongs to run" not in out and "of another run" not in out
    assert run.start_step == 1 and run.run_id == run_id and f"resumed from {run_dir}/checkpoints/step_00000001" in out
    assert run_metrics(run_dir) == run_metrics(finished)  # step 2 retrained from step 1 as the first run trained it


def test_a_changed_train_file_with_the_same_rows_is_refused(tmp_path):
    records = toy_records(ToyTaskConfig(num_train=24, seed=3), "train")
    data = tmp_path / "train.parquet"
    write_aime_style_parquet(data, records)
    run_dir = tmp_path / "run"
    train(quick_config(run_dir, data={"train_files": [str(data)]}, trainer={"total_steps": 1}))
    old_hash = file_sha256(data)
    changed = [dataclasses.replace(records[0], ground_truth=records[0].ground_truth + "0"), *records[1:]]
    write_aime_style_parquet(data, changed)  # same row count, one answer changed
    with pytest.raises(ResumeRefused, match=rf"data.train_files \[\"sha256:{old_hash}\"\] -> \[\"sha256:"):
        train(resume_config(run_dir, data={"train_files": [str(data)]}))


def _model_dir(path, cls, config_cls, tokenizer, **extra):
    config = config_cls(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                        tie_word_embeddings=True, **extra)
    torch.manual_seed(0)
    cls(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _qwen_and_llama_dirs(tmp_path):
    """A tiny Qwen2 and a tiny Llama model dir with the toy tokenizer, and a toy train file's data fields."""
    tokenizer = build_toy_tokenizer(ToyTaskConfig())
    qwen = _model_dir(tmp_path / "qwen", Qwen2ForCausalLM, Qwen2Config, tokenizer)
    llama = _model_dir(tmp_path / "llama", LlamaForCausalLM, LlamaConfig, tokenizer)
    data = tmp_path / "train.parquet"
    write_aime_style_parquet(data, toy_records(ToyTaskConfig(num_train=24), "train"))
    return qwen, llama, {"train_files": [str(data)]}


def test_a_resume_with_another_architecture_is_refused(tmp_path):
    qwen, llama, files = _qwen_and_llama_dirs(tmp_path)
    run_dir = tmp_path / "run"
    train(quick_config(run_dir, model={"path": str(qwen)}, data=files, trainer={"total_steps": 1}))
    with pytest.raises(ResumeRefused, match=r"model.architecture Qwen2ForCausalLM -> LlamaForCausalLM; "
                                            r"model.config.model_type qwen2 -> llama.*model.parameters sha256:"):
        train(resume_config(run_dir, model={"path": str(llama)}, data=files))
    with pytest.raises(ResumeRefused, match="'model.architecture' cannot be allowed"):
        train(resume_config(run_dir, model={"path": str(llama)}, data=files,
                      checkpoint={"allow_changes": ["model.architecture"]}))


def _gemma3_run(tmp_path, cap: float):
    """A 1-step run on a tiny Gemma 3 (text) directory whose final logits are capped at `cap` (the released
    models' 30), checkpointed; then its config.json's cap set to 5, as the user probe did. (run dir, its
    model.path and data overrides)."""
    model = model_dir(tmp_path / "gemma", "gemma3_text", positions=128, final_logit_softcapping=cap)
    data = tmp_path / "train.parquet"
    write_aime_style_parquet(data, toy_records(ToyTaskConfig(num_train=24), "train"))
    given = {"model": {"path": str(model)}, "data": {"train_files": [str(data)], "max_prompt_length": 64}}
    run_dir = tmp_path / "run"
    train(quick_config(run_dir, **given, trainer={"total_steps": 1}))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 5.0}))
    return run_dir, given


def test_a_changed_softcap_is_refused_in_one_line_and_resumes_once_allowed(tmp_path, capsys):
    """Gemma 3's final-logit cap 30 -> 5 keeps every shape (the weights load) but changes every log-prob: refused
    naming it old -> new with the allowance that accepts it; accepted, the resumed run computes with the new cap."""
    run_dir, given = _gemma3_run(tmp_path, 30.0)
    with pytest.raises(ResumeRefused) as info:
        train(resume_config(run_dir, **given))
    message = str(info.value)
    assert "\n" not in message and "step_00000001" in message, message
    assert "model.function.final_logit_softcapping 30.0 -> 5.0" in message, message
    assert message.endswith("--checkpoint.allow-changes model.function.final_logit_softcapping"), message
    run = train(resume_config(run_dir, **given, checkpoint={"allow_changes": ["model.function.final_logit_softcapping"]}))
    out = capsys.readouterr().out
    assert "settings changed from the checkpoint's (checkpoint.allow_changes=model.function.final_logit_softcapping): " \
           "model.function.final_logit_softcapping 30.0 -> 5.0" in out, out
    assert run.start_step == 1 and [r["step"] for r in run_metrics(run_dir)] == [1, 2]
    assert final_logit_softcap(run.policy.config) == 5.0


def test_a_checkpoint_recording_no_function_fields_resumes_with_them_unknown(tmp_path):
    """A checkpoint written before the model.function.* records (here: the records taken out of it) compares
    none of them: a changed cap is unknown to it, not a change; every other setting is still compared."""
    run_dir, given = _gemma3_run(tmp_path, 30.0)
    state_file = run_dir / "checkpoints" / "step_00000001" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)
    assert state["settings"]["model.function.final_logit_softcapping"] == 30.0
    state["settings"] = {k: v for k, v in state["settings"].items() if not k.startswith("model.function.")}
    torch.save(state, state_file)
    with pytest.raises(ResumeRefused, match=r"optim.lr 0.0005 -> 0.002"):
        train(resume_config(run_dir, **given, optim={"lr": 2e-3}))
    run = train(resume_config(run_dir, **given))
    assert run.start_step == 1 and [r["step"] for r in run_metrics(run_dir)] == [1, 2]


@pytest.mark.parametrize("with_run_json", [True, False], ids=["run-json", "no-run-json"])
def test_checkpoints_of_two_runs_in_one_directory_are_refused_naming_them(tmp_path, with_run_json):
    """Another run's checkpoint copied into checkpoints/, older or newer than this run's, with or without
    run.json: refused in one line naming both runs, nothing touched (no splice of two runs' metrics)."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    first = train(quick_config(mine, checkpoint={"save_every": 2}))  # checkpoint at step 2 only
    second = train(quick_config(other, trainer={"total_steps": 3, "seed": 1}))  # steps 1, 2, 3
    if not with_run_json:
        (mine / "run.json").unlink()
    before = (mine / "metrics.jsonl").read_text()
    for step in (1, 3):  # older than this run's newest, then newer
        shutil.copytree(other / "checkpoints" / f"step_{step:08d}", mine / "checkpoints" / f"step_{step:08d}")
        with pytest.raises(ResumeRefused) as info:
            train(resume_config(mine, trainer={"total_steps": 4}))
        message = str(info.value)
        assert "\n" not in message and "holds checkpoints of 2 run(s)" in message, message
        assert f"run {first.run_id}: step_00000002" in message and f"run {second.run_id}: " in message, message
        assert ("its run.json records run " + first.run_id if with_run_json else "no run.json says") in message
        assert (mine / "metrics.jsonl").read_text() == before
        assert sorted(p.name for p in (mine / "checkpoints").iterdir())[-1] == f"step_{max(step, 2):08d}"
    # Only the other run's checkpoints: with run.json naming this run, refused; without, that run is adopted.
    shutil.rmtree(mine / "checkpoints" / "step_00000002")
    if with_run_json:
        with pytest.raises(ResumeRefused, match=f"holds checkpoints of 1 run\\(s\\) \\(run {second.run_id}: "
                                                f"step_00000003, step_00000001\\) and its run.json records run "
                                                f"{first.run_id}"):
            train(resume_config(mine, trainer={"total_steps": 4}))


def test_another_runs_checkpoint_by_path_or_behind_a_damaged_one_is_refused(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    first = train(quick_config(mine, checkpoint={"save_every": 2}))
    second = train(quick_config(other, trainer={"total_steps": 3, "seed": 1}))
    before = (mine / "metrics.jsonl").read_text()
    # Named by path from another run's directory.
    with pytest.raises(ResumeRefused, match=f"belongs to run {second.run_id}, but this run directory holds run "
                                            f"{first.run_id}"):
        train(resume_config(mine, checkpoint={"resume": str(other / "checkpoints" / "step_00000002")}))
    # Behind a damaged newest checkpoint (its marker names no run), another run's readable one.
    shutil.copytree(other / "checkpoints" / "step_00000003", mine / "checkpoints" / "step_00000004")
    shutil.copytree(other / "checkpoints" / "step_00000001", mine / "checkpoints" / "step_00000003")
    (mine / "checkpoints" / "step_00000004" / "COMPLETE").write_text("{not json")
    with pytest.raises(ResumeRefused, match=f"run {second.run_id}: step_00000003"):
        train(resume_config(mine, trainer={"total_steps": 5}))
    assert (mine / "metrics.jsonl").read_text() == before


def _merged(*trees: dict) -> dict:
    out: dict = {}
    for tree in trees:
        for key, value in tree.items():
            out[key] = _merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.mark.parametrize("overrides, allow, restarts", [
    ({"trainer": {"seed": 7}}, ["trainer.seed"], True),
    ({"data": {"shuffle": False}}, ["data.shuffle"], True),
    ({"data": {"toy": {"num_train": 40}}}, ["data.toy"], True),
    ({"data": {"max_prompt_length": 40}}, ["data.max_prompt_length"], False),
    ({"trainer": {"train_batch": 8, "gen_batch": 8, "mini_batch": 4, "ppo_epochs": 2}}, ["trainer"], False),
    ({"rollout": {"n": 2, "max_response_length": 12, "temperature": 0.9}}, ["rollout"], False),
    ({"algorithm": {"clip_high": 0.3, "loss_agg_mode": "seq-mean-token-mean"}}, ["algorithm"], False),
    ({"optim": {"lr": 1e-3, "betas": [0.8, 0.99]}}, ["optim"], False),
    ({"model": {"dtype": "bfloat16"}}, ["model.dtype"], False),
], ids=["seed", "shuffle", "toy-data", "prompt-length", "batch", "rollout", "algorithm", "optim", "dtype"])
def test_every_change_allow_changes_accepts_really_resumes(run_dir, capsys, overrides, allow, restarts):
    run = train(resume_config(run_dir, **_merged(overrides, {"trainer": {"total_steps": 3},
                                                       "checkpoint": {"allow_changes": allow}})))
    out = capsys.readouterr().out
    assert run.start_step == 2 and [r["step"] for r in run_metrics(run_dir)] == [1, 2, 3], out
    assert "settings changed from the checkpoint's" in out
    restarted = [line for line in out.splitlines() if "the prompt order restarts" in line]
    assert len(restarted) == (1 if restarts else 0), out


def test_an_accepted_train_file_change_restarts_the_prompt_order_over_the_new_data(tmp_path, capsys):
    data = tmp_path / "train.parquet"
    write_aime_style_parquet(data, toy_records(ToyTaskConfig(num_train=24, seed=3), "train"))
    run_dir = tmp_path / "run"
    train(quick_config(run_dir, data={"train_files": [str(data)]}, trainer={"total_steps": 2}))
    write_aime_style_parquet(data, toy_records(ToyTaskConfig(num_train=30, seed=4), "train"))
    capsys.readouterr()
    run = train(resume_config(run_dir, data={"train_files": [str(data)]}, trainer={"total_steps": 3},
                        checkpoint={"allow_changes": ["data.train_files"]}))
    lines = [line for line in capsys.readouterr().out.splitlines() if "the prompt order restarts" in line]
    assert lines == ["flashdapo: data.train_files changed (checkpoint.allow_changes): the prompt order restarts at "
                     "the first prompt of this run's data (30 prompts) instead of the checkpoint's position (epoch 0, "
                     "prompt 8 of 24)"]
    assert run.start_step == 2 and [r["step"] for r in run_metrics(run_dir)] == [1, 2, 3]
    assert run.sampler.state_dict()["position"] == 4  # step 3 drew the first gen_batch of the new order


def test_a_refusal_never_suggests_an_allowance_that_is_refused(tmp_path):
    """A changed architecture: the refusal names it as impossible and suggests no --checkpoint.allow-changes
    (which would be refused too)."""
    qwen, llama, files = _qwen_and_llama_dirs(tmp_path)
    train(quick_config(tmp_path / "run", model={"path": str(qwen)}, data=files, trainer={"total_steps": 1}))
    with pytest.raises(ResumeRefused) as info:
        train(resume_config(tmp_path / "run", model={"path": str(llama)}, data=files, optim={"lr": 1e-3}))
    message = str(info.value)
    assert "optim.lr 0.0005 -> 0.001" in message and "model.architecture, model.config.model_type" in message
    assert "cannot be allowed" in message and "--checkpoint.allow-changes" not in message, message


@pytest.mark.parametrize("total", [2, 1], ids=["at", "past"])
def test_a_resume_with_nothing_to_train_says_so_and_keeps_the_export(run_dir, capsys, total):
    export = run_dir / "export" / "model.safetensors"
    before, metrics = export.stat().st_mtime_ns, run_metrics(run_dir)
    run = train(resume_config(run_dir, trainer={"total_steps": total}))
    out = capsys.readouterr().out
    where = "at" if total == 2 else "past"
    assert f"step 2 is {where} trainer.total_steps={total}: nothing to train (raise --trainer.total-steps" in out
    assert f"the export in {run_dir / 'export'} already holds step 2: kept, not rewritten" in out
    assert run.start_step == 2 and export.stat().st_mtime_ns == before and run_metrics(run_dir) == metrics
    shutil.rmtree(run_dir / "export")  # an export that is missing (a crash during it) is written
    train(resume_config(run_dir, trainer={"total_steps": total}))
    assert "exported the final policy" in capsys.readouterr().out and export.is_file()

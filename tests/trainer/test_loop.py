"""The DAPO loop end to end on the toy task (seconds), and dynamic sampling with a scripted scorer."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from flashdapo.__main__ import main as cli
from flashdapo.config import ToyTaskConfig, merge, toy
from flashdapo.data import PromptSampler
from flashdapo.distributed.mesh import DistEnv, shutdown
from flashdapo.profiling import StageTimer
from flashdapo.reward import RewardError, Verdict
from flashdapo.tasks.toy import toy_records
from flashdapo.trainer import loop
from flashdapo.trainer.collect import filter as sampling
from flashdapo.trainer.collect.filter import DynamicSamplingError
from flashdapo.trainer.collect.rounds import collect_groups
from flashdapo.trainer.loop import train, train_step
from flashdapo.trainer.observe.sinks import REQUIRED_KEYS, format_line
from flashdapo.trainer.setup import setup_run
from flashdapo.trainer.state.export import export_hf
from tests.helpers.collecting import collect
from tests.helpers.data_files import write_aime_style_parquet
from tests.helpers.runs import tiny_config
from tests.trainer.scripted import PlainTokenizer, ScriptedEngine, numbered_prompts


def _read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_end_to_end_run_writes_metrics_plot_and_loadable_export(tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir)
    run = setup_run(cfg)
    try:
        metrics = train_step(run, 1)
        missing = [k for k in REQUIRED_KEYS if k not in metrics]
        assert not missing, f"metrics lack {missing}"
        assert all(math.isfinite(metrics[k]) for k in REQUIRED_KEYS)
        assert metrics["train/num_gen_batches"] == 1 and metrics["actor/grad_norm"] > 0
        assert metrics["critic/advantages/max"] > 0 > metrics["critic/advantages/min"]
        # The trained policy's logits, then the export's: the same function.
        x = torch.randint(3, len(run.tokenizer), (2, 9))
        with torch.no_grad():
            expected = run.policy(input_ids=x).logits
        export_hf(run.weights.export(), run.policy.config, run.tokenizer, run_dir / "export", True)
    finally:
        shutdown()
    loaded = AutoModelForCausalLM.from_pretrained(run_dir / "export")
    with torch.no_grad():
        got = loaded(input_ids=x).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_train_cli_path_runs_validation_checkpoint_plot_and_eval(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    # The loop's heartbeat at logging.heartbeat_s / 100 (the field allows 1 s at least; a tiny step is shorter).
    real_heartbeat = loop.heartbeat
    monkeypatch.setattr(loop, "heartbeat", lambda step, timer, every_s, enabled: real_heartbeat(step, timer,
                                                                                                every_s / 100, enabled))
    # Activation checkpointing on: same loop, recomputed blocks.
    train(tiny_config(run_dir, model={"gradient_checkpointing": True},
                      checkpoint={"save_every": 1, "keep_last": 1}, logging={"progress": True, "heartbeat_s": 1.0}))
    assert "flashdapo: step 1: in " in capsys.readouterr().out  # a step longer than heartbeat_s says where it is
    records = _read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "val/acc/mean@k" in records[0] and "val/acc/mean@k" in records[-1]
    for r in records[1:]:
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"])
        assert r["critic/score/max"] <= 1.0 and r["critic/score/min"] >= -2.0
    assert (run_dir / "training_dynamics.png").stat().st_size > 10_000
    assert (run_dir / "config.yaml").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]
    assert (run_dir / "export" / "model.safetensors").is_file()
    assert not (run_dir / "profile").exists()  # profiling off (no profile.steps): no trace, no directory

    # `flashdapo eval` on the export, with an AIME-schema parquet (each problem twice: deduplicated).
    records = toy_records(ToyTaskConfig(num_val=5), "val")
    write_aime_style_parquet(tmp_path / "eval.parquet", records + records)
    assert cli(["eval", "--model", str(run_dir / "export"), "--data", str(tmp_path / "eval.parquet"),
                "--out", str(tmp_path / "eval"), "--k", "3", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "5 unique prompts, 5 duplicates" in out and "mean@3 |" in out and "maj@3 |" in out


def test_same_seed_same_first_step(tmp_path):
    firsts = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        train(tiny_config(run_dir, trainer={"total_steps": 1}, checkpoint={"export_hf": False}))
        firsts.append({k: v for k, v in _read_metrics(run_dir)[1].items()
                       if not k.startswith(("timing_s/", "perf/"))})
    assert firsts[0] == firsts[1]


# ---------------------------------------------------------------------------------------------------
# Dynamic sampling with a scripted engine and scorer


def test_partly_informative_refills_to_exactly_train_batch_whole_groups():
    # Prompts 0..11 in order, 4 per round; informative: 1, 2 (round 1), 5 (round 2), 8, 9, 10 (round 3).
    collected = collect({1, 2, 5, 8, 9, 10})
    assert collected.num_gen_batches == 3
    assert [int(g.prompt[0]) for g in collected.groups] == [1, 2, 5, 8]
    assert all(g.size == 4 for g in collected.groups)
    assert collected.groups_informative == 6 and collected.groups_generated == 12
    # Every response sampled counts, kept or not (train/generated_tokens): 3 rounds of 4 prompts x 4.
    every = collect(set(range(12)), trainer={"train_batch": 12, "gen_batch": 12})
    assert collected.generated_tokens == sum(len(r) for g in every.groups for r in g.responses) > 0


def test_no_informative_group_raises_with_counts():
    with pytest.raises(DynamicSamplingError, match=r"found 0 informative groups in 3 generation rounds"):
        collect(set(), algorithm={"max_gen_batches": 3, "on_max_gen_batches": "error"})


def test_no_informative_group_continue_trains_on_what_it_has():
    with pytest.warns(UserWarning, match="training on what was found"):
        collected = collect({2}, algorithm={"max_gen_batches": 2, "on_max_gen_batches": "continue"})
    assert collected.num_gen_batches == 2 and [int(g.prompt[0]) for g in collected.groups] == [2]


def test_short_batch_keeps_the_mini_batch_size_and_takes_fewer_optimizer_steps():
    # train_batch 8 in mini-batches of 4 (2 optimizer steps); two rounds find 3 informative groups (1, 2, 5).
    with pytest.warns(UserWarning, match=r"3 groups in 1 mini-batches of up to 4 \(instead of 2\)"):
        collected = collect({1, 2, 5}, algorithm={"max_gen_batches": 2, "on_max_gen_batches": "continue"},
                             trainer={"train_batch": 8, "mini_batch": 4})
    assert [[int(g.prompt[0]) for g in part] for part in collected.mini_batches] == [[1, 2, 5]]
    with pytest.warns(UserWarning, match=r"5 groups in 2 mini-batches of up to 4 \(instead of 2\)"):
        collected = collect({0, 1, 2, 5, 6}, algorithm={"max_gen_batches": 2, "on_max_gen_batches": "continue"},
                             trainer={"train_batch": 8, "mini_batch": 4})
    assert [len(part) for part in collected.mini_batches] == [4, 1]


@pytest.mark.parametrize("metric, kept", [("acc", []), ("score", [0, 2])])
def test_filter_metric_score_keeps_groups_whose_scores_differ(metric, kept):
    # Every answer is wrong (acc all False); prompts 0 and 2 get partial credit on one sample: only the shaped
    # score tells their responses apart.
    def verify(text, truth):
        prompt_id, sample = map(int, text.split())
        return Verdict(-0.5 if prompt_id in (0, 2) and sample == 1 else -1.0, False, text)
    with pytest.warns(UserWarning, match="training on what was found"):
        collected = collect(set(), algorithm={"filter_metric": metric, "max_gen_batches": 1,
                                               "on_max_gen_batches": "continue"}, verifier=verify)
    assert [int(g.prompt[0]) for g in collected.groups] == kept


def test_extra_generation_rounds_of_a_long_step_print_their_progress(capsys, monkeypatch):
    collect({1, 2, 5, 8, 9, 10})  # rounds of milliseconds: the step line's `rounds N` says enough
    assert "generation round" not in capsys.readouterr().out
    monkeypatch.setattr(sampling, "ROUND_LINE_AFTER_S", 0.0)  # as if each round took longer than the bound
    collect({1, 2, 5, 8, 9, 10})
    lines = [line for line in capsys.readouterr().out.splitlines() if "generation round" in line]
    assert lines == ["flashdapo: step 1: generation round 2: 2 of 4 informative groups kept so far",
                     "flashdapo: step 1: generation round 3: 3 of 4 informative groups kept so far"]


def test_unbounded_dynamic_sampling_warns_with_the_kept_rate():
    # Informative prompts only in rounds 21 and 22 (4 prompts a round): the warning after round 20 says so.
    with pytest.warns(UserWarning, match=r"step 1: 20 generation rounds kept 0 of 80 groups \(0.0%\); train_batch "
                                         r"needs 4: it may never end. algorithm.max_gen_batches=0 is unbounded"):
        collected = collect({80, 81, 84, 85}, num_prompts=88, algorithm={"max_gen_batches": 0})
    assert collected.num_gen_batches == 22 and len(collected.groups) == 4


def test_a_non_finite_reward_names_the_prompt_and_response():
    def verifier(text, truth):
        return Verdict(float("nan") if text.startswith("3 ") else -1.0, False, "")

    with pytest.raises(RewardError, match=r"reward nan for prompt t:3 \(response ending '3 0'\)"):
        collect_groups(1, PromptSampler(numbered_prompts(4), 4, seed=0, shuffle=False), ScriptedEngine(),
                       PlainTokenizer(), verifier, merge(toy(), {"rollout": {"n": 2}, "trainer": {
                           "train_batch": 4, "gen_batch": 4, "mini_batch": 2}}),
                       DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), mesh=None),
                       StageTimer(torch.device("cpu")))


def test_dynamic_sampling_off_keeps_everything():
    collected = collect(set(), algorithm={"dynamic_sampling": False})
    assert collected.num_gen_batches == 1 and len(collected.groups) == 4


def test_step_without_informative_groups_leaves_weights_alone(tmp_path):
    # Every answer judged wrong: with dynamic sampling on and `continue`, no group is kept.
    cfg = tiny_config(tmp_path / "run", algorithm={"dynamic_sampling": True, "max_gen_batches": 1,
                                                     "on_max_gen_batches": "continue"})
    run = setup_run(cfg)
    run.verifier = lambda text, truth: Verdict(-1.0, False, "")
    try:
        before = {n: t.clone() for n, t in run.weights.export()}
        with pytest.warns(UserWarning, match="found 0 informative groups"):
            metrics = train_step(run, 1)
        after = {n: t.clone() for n, t in run.weights.export()}
    finally:
        shutdown()
    assert metrics["train/kept_groups"] == 0 and metrics["actor/skipped_steps"] == 0
    assert metrics["train/mini_batches"] == 1  # one empty mini-batch, skipped
    assert all(torch.equal(before[n], after[n]) for n in before)
    # No optimizer step: the LR schedule stays, and nothing is reported as a score or a loss (no fake 0).
    assert run.scheduler.last_epoch == 0 and run.weights.version == 0
    assert not [k for k in metrics if k.startswith(("critic/", "response_length/")) or k == "actor/grad_norm"]
    line = format_line(metrics, 2)
    assert "no group kept, acc 0.000 | no update |" in line and "score" not in line

"""The logs the paper's figures need: the all-equal / all-correct / all-wrong shares of generated groups with
dynamic sampling on and off, length and entropy split by verdict, the clip regions in a real step, the probe
(deterministic, moved by the weights), and a run on the random reward. Toy task or a scripted engine (seconds)."""

import math

import pytest
import torch

from flashdapo.distributed.mesh import shutdown
from flashdapo.reward import Verdict
from flashdapo.trainer.loop import probe, split_metrics, train_step
from flashdapo.trainer.observe.probe import build_probe_set, probe_due, probe_metrics
from flashdapo.trainer.setup import setup_run
from tests.helpers.collecting import collect
from tests.helpers.runs import tiny_config

NEW_STEP_KEYS = ("actor/clipfrac_upper", "actor/clipfrac_lower", "actor/clipfrac_dual", "train/all_equal_fraction",
                 "train/all_correct_fraction", "train/all_wrong_fraction", "train/generated_samples_cum",
                 "train/generated_tokens_cum")


def _verifier(all_right, one_right):
    """Prompts in all_right: every response correct; in one_right: only sample 0; the rest: all wrong."""
    def verify(text, truth):
        prompt_id, sample = map(int, text.split())
        ok = prompt_id in all_right or (prompt_id in one_right and sample == 0)
        return Verdict(1.0 if ok else -1.0, ok, text)
    return verify


@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_all_equal_share_counts_generated_groups_with_or_without_dynamic_sampling(dynamic_sampling):
    # Round 1 holds prompts 0..3: 0 all correct, 1 informative, 2 and 3 all wrong.
    trainer = {"train_batch": 4, "gen_batch": 4} if not dynamic_sampling else {"train_batch": 1, "gen_batch": 4,
                                                                                "mini_batch": 1}
    collected = collect(set(), algorithm={"dynamic_sampling": dynamic_sampling}, trainer=trainer,
                         verifier=_verifier(all_right={0}, one_right={1}))
    assert collected.groups_generated == 4 and collected.num_gen_batches == 1
    assert (collected.groups_all_equal, collected.groups_all_correct, collected.groups_all_wrong) == (3, 1, 2)
    # Without the filter every group trains (kept = generated); with it only the informative one.
    assert collected.groups_informative == (1 if dynamic_sampling else 4)
    assert len(collected.groups) == (1 if dynamic_sampling else 4)
    assert collected.generated_samples == 16


def test_split_metrics_by_verdict_and_region():
    means = {"clip_upper": 0.1, "clip_lower": 0.2, "clip_dual": 0.03, "upclip_old_prob": 0.4, "upclip_tail": 0.25,
             "entropy_correct": 1.5}
    acc = torch.tensor([True, False, False, True])
    out = split_metrics(means, acc, torch.tensor([2, 10, 20, 4]))
    assert out == {"actor/clipfrac_upper": 0.1, "actor/clipfrac_lower": 0.2, "actor/clipfrac_dual": 0.03,
                   "actor/upclip_old_prob": 0.4, "actor/upclip_tail_fraction": 0.25, "actor/entropy_correct": 1.5,
                   "response_length/correct_mean": 3.0, "response_length/wrong_mean": 15.0}
    # No wrong response, no entropy of wrong tokens: those keys are absent, never 0.
    out = split_metrics(means, torch.tensor([True, True]), torch.tensor([3, 5]))
    assert "response_length/wrong_mean" not in out and "actor/entropy_wrong" not in out


def test_probe_due_every_n_steps():
    assert [s for s in range(0, 12) if probe_due(5, s)] == [0, 5, 10]
    assert not any(probe_due(0, s) for s in range(3))


@pytest.fixture
def run(tmp_path):
    # Two mini-batches of two epochs: the later ones move the ratio away from 1, so the clip regions can fill.
    cfg = tiny_config(tmp_path / "run", trainer={"ppo_epochs": 2}, optim={"lr": 3e-2},
                      logging={"probe_every": 1, "probe_prompts": 4})
    run = setup_run(cfg)
    yield run
    shutdown()


def test_a_step_logs_every_new_metric_consistently(run):
    metrics = train_step(run, 1)
    missing = [k for k in NEW_STEP_KEYS if k not in metrics]
    assert not missing, missing
    regions = metrics["actor/clipfrac_upper"] + metrics["actor/clipfrac_lower"] + metrics["actor/clipfrac_dual"]
    assert metrics["actor/pg_clipfrac"] == pytest.approx(regions, abs=1e-12)
    assert metrics["actor/pg_clipfrac_lower"] == metrics["actor/clipfrac_dual"]
    # filter_metric=acc: an all-equal group is all correct or all wrong.
    assert metrics["train/all_equal_fraction"] == pytest.approx(metrics["train/all_correct_fraction"] +
                                                                metrics["train/all_wrong_fraction"])
    cfg = run.cfg
    assert metrics["train/generated_samples_cum"] == cfg.trainer.gen_batch * cfg.rollout.n
    assert metrics["train/generated_tokens_cum"] == metrics["train/generated_tokens"]
    assert ("response_length/correct_mean" in metrics) == (metrics["train/gen_acc"] > 0)
    if "actor/upclip_old_prob" in metrics:
        assert 0 < metrics["actor/upclip_old_prob"] <= 1 and 0 <= metrics["actor/upclip_tail_fraction"] <= 1
    second = train_step(run, 2)
    assert second["train/generated_samples_cum"] == 2 * cfg.trainer.gen_batch * cfg.rollout.n
    assert second["train/generated_tokens_cum"] == metrics["train/generated_tokens"] + second["train/generated_tokens"]


def test_probe_is_deterministic_and_moves_with_the_weights(run):
    assert len(run.probe) == 4  # the first 4 distinct validation prompts, each with "Answer: <truth>" + eos
    logged = probe(run, 1)
    assert set(logged) == {"probe/entropy", "probe/top1_prob", "timing_s/probe"}
    measure = lambda: probe_metrics(run.policy, run.probe, run.cfg.trainer.micro_batch_tokens,  # noqa: E731
                                    run.pad_id, run.env.device)
    first = measure()
    assert first == measure() == {k: v for k, v in logged.items() if k.startswith("probe/")}  # bitwise repeat
    assert first["probe/entropy"] > 0 and 0 < first["probe/top1_prob"] <= 1
    with torch.no_grad():  # the final norm's scale multiplies every logit by 1.5: sharper distributions
        run.policy.hf.model.norm.weight.mul_(1.5)
    sharper = measure()
    assert sharper["probe/entropy"] < first["probe/entropy"] and sharper["probe/top1_prob"] > first["probe/top1_prob"]
    # A training step moves the weights, and so the probe.
    train_step(run, 1)
    assert measure() != sharper


def test_probe_set_takes_distinct_prompts_in_order(run):
    prompts = list(run.val_prompts)
    probe_set = build_probe_set(prompts[:2] + prompts, run.tokenizer, 3)
    assert [p.tolist() for p in probe_set.prompts] == [p.ids for p in prompts[:3]]
    eos = run.tokenizer.convert_tokens_to_ids(run.tokenizer.eos_token)
    text = run.tokenizer.decode(probe_set.responses[0][:-1].tolist())
    assert probe_set.responses[0][-1].item() == eos and text.replace(" ", "") == f"Answer:{prompts[0].ground_truth}"


def test_a_run_on_the_random_reward_trains_and_validates_with_the_task_verifier(tmp_path):
    cfg = tiny_config(tmp_path / "run", algorithm={"verifier": "random", "random_reward_p": 1.0})
    run = setup_run(cfg)
    try:
        metrics = train_step(run, 1)
        # p = 1: every response is rewarded, whatever the untrained policy wrote.
        assert metrics["train/gen_acc"] == 1.0 and metrics["train/all_correct_fraction"] == 1.0
        assert math.isfinite(metrics["actor/pg_loss"])
        assert run.verifier.__name__ == "dapo_verify"  # validation judges the task
    finally:
        shutdown()

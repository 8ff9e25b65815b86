"""The rollout correction: every mode against a float64 formula, exact no-op on identical log-probs, and a
torch-engine run whose sampler deliberately differs from the trainer."""

import math

import pytest
import torch

from flashdapo.algorithm import (
    on_policy,
    resolved_rollout_correction,
    rollout_correction_sums,
    rollout_correction_weights,
    token_loss,
)
from flashdapo.config import AlgorithmConfig, Config, ConfigError, engine_spec, merge
from flashdapo.distributed.mesh import shutdown
from flashdapo.trainer.loop import train_step
from flashdapo.trainer.setup import setup_run
from tests.helpers.runs import tiny_config

MODES = ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
CAP = 2.0


def _batch(seed=0):
    """Responses of odd lengths; per token: trainer log-probs now (logp) and before the update (old), and the
    rollout engine's (rollout), with rollout ratios pi_old / pi_rollout spanning 0.2 .. 5; both advantage signs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 1, 6, 2, 5, 4, 7])
    n = int(lengths.sum())
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.05
    rho = torch.exp(torch.linspace(math.log(0.2), math.log(5.0), n, dtype=torch.float64)[torch.randperm(n, generator=g)])
    rollout = old - rho.log()
    logp = old + torch.empty(n, dtype=torch.float64).uniform_(-0.5, 0.5, generator=g)
    adv = torch.repeat_interleave(torch.tensor([1.3, -0.7, 0.4, -1.9, 0.8, -0.2, 1.1], dtype=torch.float64), lengths)
    return lengths, logp, old, rollout, adv


def _expected_weights(mode, lengths, old, rollout):
    """float64, written from the definitions: rho per token, or the geometric mean over the response."""
    rho = [r for r in torch.exp(old - rollout).tolist()]
    per_token, start = [], 0
    for length in lengths.tolist():
        tokens = rho[start:start + length]
        start += length
        if mode.startswith("sequence"):
            tokens = [math.prod(tokens) ** (1 / length)] * length
        for r in tokens:
            if mode == "none":
                per_token.append(1.0)
            elif mode.endswith("truncate"):
                per_token.append(min(r, CAP))
            else:
                per_token.append(1.0 if 1 / CAP <= r <= CAP else 0.0)
    return torch.tensor(per_token, dtype=torch.float64)


def _surrogate(logp, old, adv, algo):
    """The clipped surrogate per token, float64, from its definition (Clip-Higher and dual clip)."""
    r = torch.exp(logp - old)
    loss = torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - algo.clip_low, 1 + algo.clip_high))
    return torch.where(adv < 0, torch.minimum(loss, -adv * algo.clip_ratio_c), loss)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_matches_the_float64_formula(mode):
    lengths, logp, old, rollout, adv = _batch(seed=MODES.index(mode))
    weights = rollout_correction_weights(old, rollout, lengths, mode, CAP)
    expected = _expected_weights(mode, lengths, old, rollout)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=0)
    if mode.endswith("truncate"):
        assert (expected < 1).any() and (expected == CAP).any()
    if mode.endswith("mask"):
        assert (expected == 0).any() and (expected == 1).any()

    # The loss with the weights: sum over kept tokens of w * l / (kept tokens), and its gradient.
    algo = AlgorithmConfig()
    kept = weights > 0
    x = logp.clone().requires_grad_(True)
    loss, stats = token_loss(x, old, adv, kept, algo, normalizer=kept.sum(), weights=weights)
    loss.backward()
    y = logp.clone().requires_grad_(True)
    want = (expected * _surrogate(y, old, adv, algo))[expected > 0].sum() / (expected > 0).sum()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-12)
    assert stats.num_tokens.item() == int(kept.sum())


@pytest.mark.parametrize("mode", MODES)
def test_identical_log_probs_are_an_exact_no_op(mode):
    lengths, logp, old, _, adv = _batch(seed=7)
    logp, old, adv = logp.float(), old.float(), adv.float()
    weights = rollout_correction_weights(old, old.clone(), lengths, mode, CAP)
    assert torch.equal(weights, torch.ones_like(weights))
    mask = torch.rand(len(logp), generator=torch.Generator().manual_seed(1)) > 0.2
    grads = []
    for w in (None, weights):
        x = logp.clone().requires_grad_(True)
        loss, _ = token_loss(x, old, adv, mask & ((w > 0) if w is not None else True), AlgorithmConfig(),
                             normalizer=mask.sum(), weights=w)
        loss.backward()
        grads.append((loss.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_sums_and_k3_estimate():
    lengths, _, old, rollout, _ = _batch(seed=3)
    weights = rollout_correction_weights(old, rollout, lengths, "token_mask", CAP)
    valid = torch.ones(len(old), dtype=torch.bool)
    valid[:4] = False
    sums, extremes = rollout_correction_sums(old, rollout, weights, valid)
    kept = valid & (weights > 0)
    rho = torch.exp(old - rollout)
    assert sums[0] == valid.sum() and sums[1] == (valid & ~kept).sum() and sums[3] == kept.sum()
    assert sums[2] == pytest.approx(float(kept.sum()))  # mask weights are 1
    # k3 = rho - 1 - log rho, with rho = pi_old / pi_rollout and tokens sampled from the rollout policy:
    # an unbiased, non-negative estimate of KL(rollout || old).
    assert sums[4].item() == pytest.approx((rho - 1 - rho.log())[valid].sum().item(), rel=1e-9)
    assert extremes.tolist() == [-1.0, 1.0]


def test_auto_is_none_for_torch_and_token_truncate_for_vllm():
    assert resolved_rollout_correction(AlgorithmConfig(), engine_spec("torch").off_policy) == "none"
    assert resolved_rollout_correction(AlgorithmConfig(), engine_spec("vllm").off_policy) == "token_truncate"
    assert resolved_rollout_correction(AlgorithmConfig(rollout_correction="sequence_mask"), engine_spec("torch").off_policy) == "sequence_mask"
    # pi_old = the engine's own log-probs: every ratio is 1, nothing to correct (and an explicit mode is refused).
    assert resolved_rollout_correction(AlgorithmConfig(old_logprobs="rollout"), engine_spec("vllm").off_policy) == "none"
    with pytest.raises(ConfigError, match=r"^algorithm\.rollout_correction: expected 'auto' or 'none' with "):
        merge(Config(), {"algorithm": {"old_logprobs": "rollout", "rollout_correction": "token_mask"}})


def test_a_correction_recomputes_pi_old_even_on_policy():
    # One mini-batch, one epoch: pi_old is normally pi_theta itself, with no pass; the weights need its values.
    cfg = merge(Config(), {"trainer": {"mini_batch": 512}})
    assert on_policy(cfg)
    assert not on_policy(merge(cfg, {"algorithm": {"rollout_correction": "token_truncate"}}))


@pytest.mark.parametrize("mode, cap", [("token_truncate", 1.2), ("sequence_mask", 1.03)])
def test_perturbed_sampler_gets_weights_and_trains(tmp_path, mode, cap):
    """The engine samples at temperature 1.5 while the trainer computes at 1.0: the rollout log-probs differ,
    the correction weighs (or masks) tokens, and the step still trains. (The barely warmed-up toy model is
    nearly uniform, so the ratios stay near 1: small caps.)"""
    cfg = tiny_config(tmp_path / "run", algorithm={"dynamic_sampling": False, "rollout_correction": mode,
                                                   "rollout_correction_cap": cap})
    run = setup_run(cfg)
    generate = run.engine.generate
    run.engine.generate = lambda prompts, sampling: generate(prompts, type(sampling)(
        **{**sampling.__dict__, "temperature": sampling.temperature * 1.5}))
    try:
        before = {n: t.clone() for n, t in run.weights.export()}
        metrics = train_step(run, 1)
        after = {n: t.clone() for n, t in run.weights.export()}
    finally:
        shutdown()
    assert metrics["rollout_corr/k3_kl"] > 1e-3
    if mode == "token_truncate":
        assert metrics["rollout_corr/weight_min"] < 1 and metrics["rollout_corr/weight_max"] == pytest.approx(cap)
        assert metrics["rollout_corr/masked_fraction"] == 0
    else:
        assert 0 < metrics["rollout_corr/masked_fraction"] < 1
        assert metrics["rollout_corr/weight_min"] == metrics["rollout_corr/weight_max"] == 1
    assert metrics["actor/grad_norm"] > 0 and math.isfinite(metrics["actor/pg_loss"])
    assert any(not torch.equal(before[n], after[n]) for n in before)

"""pi_old: skipped when the update is on-policy (exact), the engine's log-probs with old_logprobs=rollout."""

import pytest
import torch

from flashdapo.algorithm import token_loss
from flashdapo.config import AlgorithmConfig
from flashdapo.kernels import token_logprobs
from flashdapo.trainer import update
from flashdapo.trainer.batch import Group
from tests.helpers.runs import first_step_weights, tiny_config


def test_token_loss_on_policy_equals_explicit_old_and_plain_policy_gradient():
    g = torch.Generator().manual_seed(7)
    n, h, v = 45, 12, 53
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    adv = torch.randn(n, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(n, generator=g) > 0.25
    algo = AlgorithmConfig()
    old = token_logprobs(hidden, weight, targets, impl="naive").detach()

    def grads(loss_of_logp):
        w = weight.clone().requires_grad_()
        loss = loss_of_logp(token_logprobs(hidden, w, targets, impl="torch"))
        loss.backward()
        return loss.detach(), w.grad

    loss_none, grad_none = grads(lambda lp: token_loss(lp, None, adv, mask, algo, normalizer=60.0)[0])
    loss_old, grad_old = grads(lambda lp: token_loss(lp, old, adv, mask, algo, normalizer=60.0)[0])
    _, grad_pg = grads(lambda lp: torch.where(mask, -adv * lp, 0.0).sum() / 60.0)
    torch.testing.assert_close(loss_none, loss_old, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad_none, grad_old, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(grad_none, grad_pg, rtol=1e-7, atol=1e-10)
    stats = token_loss(old.clone().requires_grad_(), None, adv, mask, algo)[1]
    assert float(stats.pg_clipfrac) == 0 and float(stats.ppo_kl) == 0 and float(stats.ratio) == float(stats.num_tokens)


def test_on_policy_step_skips_the_pass_and_matches_recompute(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path / "a", trainer={"mini_batch": 4})  # train_batch 4: one optimizer step
    real = update.compute_old_logprobs
    calls = []
    monkeypatch.setattr(update, "compute_old_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    skipped, w_skipped = first_step_weights(cfg, monkeypatch)
    assert not calls
    monkeypatch.setattr(update, "compute_old_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    recomputed, w_recomputed = first_step_weights(tiny_config(tmp_path / "b", trainer={"mini_batch": 4}),
                                                   monkeypatch, force_recompute=True)
    assert calls
    assert skipped["actor/grad_norm"] == pytest.approx(recomputed["actor/grad_norm"], rel=1e-5)
    assert skipped["actor/grad_norm"] > 0
    for a, b in zip(w_skipped, w_recomputed):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_rollout_old_logprobs_use_the_engine_and_match_recompute(tmp_path, monkeypatch):
    def no_pass(*_a, **_k):
        raise AssertionError("old_logprobs=rollout must not run the policy")

    monkeypatch.setattr(update, "compute_old_logprobs", no_pass)
    cfg = tiny_config(tmp_path / "rollout", algorithm={"old_logprobs": "rollout"})  # 2 mini-batches
    rollout, w_rollout = first_step_weights(cfg, monkeypatch)
    recomputed, w_recomputed = first_step_weights(tiny_config(tmp_path / "recompute"), monkeypatch)
    assert len(w_rollout) == len(w_recomputed)
    # The torch engine's log-probs match the trainer's to ~1e-6: the two updates barely differ.
    for a, b in zip(w_rollout, w_recomputed):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert "rollout/logprob_abs_diff_mean" not in rollout and "rollout/logprob_abs_diff_mean" in recomputed
    assert "rollout/logprob_exact_fraction" not in rollout
    assert 0 <= recomputed["rollout/logprob_exact_fraction"] <= 1


def test_rollout_old_logprobs_need_engine_logprobs(tmp_path):
    cfg = tiny_config(tmp_path, algorithm={"old_logprobs": "rollout"})
    group = Group(prompt=torch.tensor([1, 2]), responses=[torch.tensor([3])], scores=torch.ones(1),
                  acc=torch.ones(1, dtype=torch.bool), truncated=torch.zeros(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="algorithm.old_logprobs=rollout"):
        update.old_logprobs(None, [group], cfg, 0, torch.device("cpu"))

"""The trainer-vs-engine log-prob check: its schedule, its figures, its warning."""

import warnings

import pytest
import torch

from flashdapo.config import AlgorithmConfig, RolloutConfig
from flashdapo.trainer.batch import Group, build_train_batch
from flashdapo.trainer.observe import logprob_check
from flashdapo.trainer.observe.logprob_check import (
    LogprobMismatchWarning,
    logprob_agreement,
    should_check_logprobs,
)


def test_logprob_check_schedule():
    assert [s for s in range(12) if should_check_logprobs(s, 5)] == [0, 5, 10]
    assert [s for s in range(12) if should_check_logprobs(s, 0)] == [0]
    assert [s for s in range(3, 12) if should_check_logprobs(s, 4, first_step=3)] == [3, 7, 11]


def _batch(sampled, old):
    """One group per response; the engine reported `sampled`, the trainer recomputed `old`."""
    groups = [Group(torch.tensor([1]), [torch.zeros(len(o), dtype=torch.long)], torch.zeros(1),
                    torch.zeros(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool),
                    sampler_logprobs=None if s is None else [s]) for s, o in zip(sampled, old)]
    return build_train_batch([groups], old, AlgorithmConfig())


def test_agreement_reports_mean_and_max_and_warns_above_threshold():
    old = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0])]
    sampled = [torch.tensor([-1.1, -2.0, -0.2]), torch.tensor([-3.4])]
    rollout = RolloutConfig(logprob_check_every=2, logprob_check_threshold=0.1)
    with pytest.warns(LogprobMismatchWarning, match="exceeds rollout.logprob_check_threshold=0.1"):
        metrics = logprob_agreement(1, _batch(sampled, old), rollout, warn=True)
    assert metrics["rollout/logprob_abs_diff_mean"] == pytest.approx((0.1 + 0.0 + 0.3 + 0.4) / 4)
    assert metrics["rollout/logprob_abs_diff_max"] == pytest.approx(0.4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert logprob_agreement(1, _batch(sampled, old), rollout, warn=False)  # figures without a warning
        assert logprob_agreement(2, _batch(sampled, old), rollout, warn=True) == {}  # not scheduled
        assert logprob_agreement(3, _batch(old, old), rollout, warn=True)["rollout/logprob_abs_diff_max"] == 0
        # An engine that reports no log-probs (for some response) gives nothing to compare.
        assert logprob_agreement(1, _batch([None, sampled[1]], old), rollout, warn=True) == {}


def _ulp_off(t, where):
    """`t` with the elements at `where` moved one float32 ulp toward zero."""
    return torch.where(where, torch.nextafter(t, torch.zeros_like(t)), t)


def test_exact_fraction_counts_bit_equal_tokens():
    old = [torch.tensor([-1.0, -2.0, -0.5, -0.25]), torch.tensor([-3.0, -0.125, -7.5])]
    off = [torch.tensor([False, True, False, True]), torch.tensor([True, False, False])]
    sampled = [_ulp_off(o, w) for o, w in zip(old, off)]
    assert all(not torch.equal(s, o) for s, o in zip(sampled, old))
    metrics = logprob_agreement(1, _batch(sampled, old), RolloutConfig(), warn=True)
    assert metrics["rollout/logprob_exact_fraction"] == 4 / 7  # one ulp is not equal
    assert 0 < metrics["rollout/logprob_abs_diff_max"] < 1e-6
    assert logprob_agreement(1, _batch(old, old), RolloutConfig(), warn=True)[
        "rollout/logprob_exact_fraction"] == 1.0
    # Streaming: only the tokens this step's weights sampled count (the carried ones differ by design).
    batch = _batch(sampled, old)
    batch.groups[0].versions = [torch.tensor([1, 0, 1, 0])]
    assert logprob_agreement(1, batch, RolloutConfig(), warn=True)["rollout/logprob_exact_fraction"] == 4 / 5


def test_exact_fraction_is_token_weighted_over_ranks(monkeypatch):
    """Another rank with 1 token, 0 equal, beside this rank's 4 tokens, 4 equal: 4/5 of all tokens, not the mean
    of the two ranks' fractions (1/2)."""
    other = {"sum": torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64), "max": torch.tensor([0.5])}

    def two_ranks(t, op="sum", group=None):
        o = other[op].to(t.dtype)
        return t + o if op == "sum" else torch.maximum(t, o)

    monkeypatch.setattr(logprob_check, "all_reduce", two_ranks)
    old = [torch.tensor([-1.0, -2.0, -0.5, -0.25])]
    metrics = logprob_agreement(1, _batch(old, old), RolloutConfig(logprob_check_threshold=1.0), warn=True)
    assert metrics["rollout/logprob_exact_fraction"] == pytest.approx(4 / 5)
    assert metrics["rollout/logprob_abs_diff_mean"] == pytest.approx(0.5 / 5)
    assert metrics["rollout/logprob_abs_diff_max"] == pytest.approx(0.5)

"""The loss statistics through every kernel implementation: the clip regions of a batch whose counts are known
(upper, lower, dual), the up-clipped tokens' old probability and the entropy split by verdict, whatever impl
computed the log-probs (token_logprobs and the fused sweep); and the probe's no-grad statistics (top-1
probability from the forward's running max and sum) against the materialized softmax."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_accuracy import ON_CUDA, impl_params

from flashdapo.algorithm import token_loss
from flashdapo.config import AlgorithmConfig
from flashdapo.kernels import CHUNKED_IMPLS, IMPLS, fused_token_loss, token_logprobs, token_probe_stats
from flashdapo.kernels.naive import naive_token_logprobs

ALL_IMPLS = impl_params([i for i in IMPLS if i != "auto"])
FUSED_IMPLS = impl_params(CHUNKED_IMPLS)
ALGO = AlgorithmConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=10.0)

# (advantage, ratio, mask) per token, repeated to fill the batch: 1 + eps_high = 1.28, 1 - eps_low = 0.8, c = 10.
PATTERN = [(+1.0, 1.6, True),   # upper
           (+1.0, 1.1, True),   # none
           (-1.0, 0.5, True),   # lower
           (-1.0, 2.0, True),   # none (A < 0, 1.28 < r < c)
           (-1.0, 15.0, True),  # dual
           (+1.0, 0.4, True),   # none (A > 0, low ratio)
           (0.00, 5.0, True),   # none (A = 0)
           (+1.0, 2.0, False)]  # masked upper
REPEATS = 4  # 32 tokens: upper 4, lower 4, dual 4 of 28 valid


def _device(impl):
    return torch.device("cuda" if impl == "triton" and ON_CUDA else "cpu")


def _batch(impl, seed):
    torch.manual_seed(seed)
    n, hdim, vocab = len(PATTERN) * REPEATS, 24, 97
    h, w, y = torch.randn(n, hdim), torch.randn(vocab, hdim) * 0.3, torch.randint(0, vocab, (n,))
    adv, ratio, mask = (torch.tensor(col * REPEATS) for col in zip(*PATTERN))
    ref_logp, ref_entropy = naive_token_logprobs(h.double(), w.double(), y, with_entropy=True)
    # The ratios are at least 0.1 from every bound: the kernels' fp32 log-probs (|error| ~ 1e-6) cannot flip one.
    old = ref_logp - ratio.double().log()
    correct = torch.arange(n) % 2 == 0  # alternate tokens "belong" to a correct response
    dev = _device(impl)
    return [t.to(dev) for t in (h, w, y, old, adv, mask.bool(), correct)], ref_entropy


def _expected(old, ref_entropy, correct):
    adv, ratio, mask = (torch.tensor(col * REPEATS) for col in zip(*PATTERN))
    upper = (adv > 0) & (ratio > 1.28) & mask.bool()
    valid, correct = mask.bool(), correct.cpu()
    return {"clip_upper": 4 / 28, "clip_lower": 4 / 28, "clip_dual": 4 / 28, "pg_clipfrac": 12 / 28,
            "pg_clipfrac_lower": 4 / 28, "upclip_old_prob": old.cpu()[upper].exp().mean().item(),
            # the up-clipped tokens below exp(-H) at their position (new log-prob + entropy < 0)
            "upclip_tail": ((old.cpu() + ratio.double().log() + ref_entropy)[upper] < 0).double().mean().item(),
            "entropy_correct": ref_entropy[valid & correct].mean().item(),
            "entropy_wrong": ref_entropy[valid & ~correct].mean().item()}


def _check(means, expected):
    for key, value in expected.items():
        assert means[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_clip_regions_and_splits_through_token_logprobs(impl, seed):
    (h, w, y, old, adv, mask, correct), ref_entropy = _batch(impl, seed)
    logp, entropy = token_logprobs(h, w, y, with_entropy=True, impl=impl)
    _, stats = token_loss(logp, old, adv, mask, ALGO, entropy=entropy, correct=correct)
    assert stats.num_tokens.item() == 28
    assert (stats.clip_upper.item(), stats.clip_lower.item(), stats.clip_dual.item()) == (4, 4, 4)
    _check(stats.means(), _expected(old, ref_entropy, correct))


@pytest.mark.parametrize("impl", FUSED_IMPLS)
def test_clip_regions_and_splits_through_the_fused_sweep(impl, seed):
    (h, w, y, old, adv, mask, correct), ref_entropy = _batch(impl, seed)

    def loss_fn(lp, rows):
        return token_loss(lp, old[rows], adv[rows], mask[rows], ALGO, normalizer=28)[0]

    _, logp, entropy = fused_token_loss(h, w, y, loss_fn, keep=mask, impl=impl)
    # As the trainer does it: the statistics of the sweep's (detached) log-probs and entropies.
    _, stats = token_loss(logp, old, adv, mask, ALGO, normalizer=28, entropy=entropy, correct=correct)
    assert (stats.clip_upper.item(), stats.clip_lower.item(), stats.clip_dual.item()) == (4, 4, 4)
    _check(stats.means(), _expected(old, ref_entropy, correct))


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_probe_stats_match_the_materialized_softmax(impl, temperature, seed):
    (h, w, y, *_), _ = _batch(impl, seed)
    w = w * 4  # peaked rows: top-1 probabilities well away from 1 / V
    logp, entropy, top1 = token_probe_stats(h, w, y, temperature=temperature, impl=impl)
    probs = torch.softmax((h.double().cpu() @ w.double().cpu().T) / temperature, dim=-1)
    ref_logp, ref_entropy = naive_token_logprobs(h.double().cpu(), w.double().cpu(), y.cpu(), temperature, True)
    torch.testing.assert_close(top1.double().cpu(), probs.amax(-1), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logp.double().cpu(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double().cpu(), ref_entropy, rtol=1e-5, atol=1e-5)
    assert top1.dtype == torch.float32 and not top1.requires_grad
    assert (top1 > 1 / w.shape[0]).all() and (top1 <= 1).all() and math.isfinite(top1.sum().item())

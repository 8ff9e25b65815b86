"""DAPO math against values computed by hand and an independent float64 formula, branch by branch."""

import math

import pytest
import torch

from flashdapo.algorithm import (
    group_advantages,
    informative_groups,
    overlong_penalty,
    response_loss_mask,
    shaped_scores,
    token_loss,
)
from flashdapo.config import AlgorithmConfig
from flashdapo.kernels import token_logprobs


@pytest.mark.parametrize(
    "length, expected",
    [(0, 0.0), (12, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (20, -1.0), (21, -1.0), (100, -1.0)],
)
def test_overlong_penalty_ramp(length, expected):
    # L_max = 20, L_cache = 4: free up to 16, linear over 17..20, -1 beyond.
    got = overlong_penalty(torch.tensor([length]), max_len=20, buffer_len=4, factor=1.0)
    assert got.item() == pytest.approx(expected)


def test_overlong_penalty_recipe_numbers_and_factor():
    lengths = torch.tensor([16384, 16385, 18432, 20480, 20481])
    got = overlong_penalty(lengths, max_len=20480, buffer_len=4096, factor=0.5)
    expected = torch.tensor([0.0, -1 / 4096, -0.5, -1.0, -1.0]) * 0.5
    torch.testing.assert_close(got, expected)


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=5)


def test_group_advantages_hand_computed():
    scores = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, -2.0, 0.5])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 11])  # arbitrary ids, interleaved sizes 4, 2, 1
    adv = group_advantages(scores, groups, eps=1e-6)
    # Group 7: mean -0.5, unbiased std sqrt((2.25 + 3 * 0.25) / 3) = 1.
    s7 = math.sqrt((1.5**2 + 3 * 0.5**2) / 3)
    # Group 3: mean -0.5, unbiased std sqrt((1.5^2 * 2) / 1).
    s3 = math.sqrt(2 * 1.5**2)
    expected = [1.5 / (s7 + 1e-6), -0.5 / (s7 + 1e-6), -0.5 / (s7 + 1e-6), -0.5 / (s7 + 1e-6),
                1.5 / (s3 + 1e-6), -1.5 / (s3 + 1e-6), 0.5 / (1 + 1e-6)]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float32))


def test_group_advantages_all_equal_group_is_zero():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    assert torch.equal(adv, torch.zeros(3))


def test_informative_groups_uses_acc_not_score():
    acc = torch.tensor([True, True, False, False, True, False, True])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    keep = informative_groups(acc, groups)
    assert keep.tolist() == [False, False, False, False, True, True, True]


def _branch_formula(logp, old, adv, clip_low, clip_high, c):
    """Per-token loss and d loss / d logp written out case by case (docs/algorithm.md)."""
    losses, grads = [], []
    for lp, lo, a in zip(logp.tolist(), old.tolist(), adv.tolist()):
        r = torch.tensor(lp - lo, dtype=torch.float64).exp().item()
        clipped = (a > 0 and r > 1 + clip_high) or (a < 0 and r < 1 - clip_low)
        if clipped:
            loss, grad = -a * min(max(r, 1 - clip_low), 1 + clip_high), 0.0
        else:
            loss, grad = -a * r, -a * r
        if c is not None and a < 0 and loss > -a * c:
            loss, grad = -a * c, 0.0
        losses.append(loss)
        grads.append(grad)
    return torch.tensor(losses, dtype=torch.float64), torch.tensor(grads, dtype=torch.float64)


def _inputs(n=64, h=12, v=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    logp = token_logprobs(hidden, weight, targets, impl="naive")
    # Ratios spanning [0.3, 4] (log-uniform) and advantages of both signs.
    ratio = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(-1.2, 1.4, generator=g))
    old = logp - ratio.log()
    adv = torch.randn(n, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(n, generator=g) > 0.2
    return hidden, weight, targets, old, adv, mask


def _loss(hidden, weight, targets, old, adv, mask, algo=None, normalizer=None):
    """The trainer's composition: reference log-probs through the LM head, then the token loss."""
    logp = token_logprobs(hidden, weight, targets, impl="naive")
    return token_loss(logp, old, adv, mask, algo or AlgorithmConfig(), normalizer=normalizer)


@pytest.mark.parametrize("clip_ratio_c", [10.0, 3.0, 1.5, None])
@pytest.mark.parametrize("clips", [(0.2, 0.28), (0.1, 0.5)])
def test_naive_loss_matches_branch_formula(clip_ratio_c, clips):
    clip_low, clip_high = clips
    hidden, weight, targets, old, adv, mask = _inputs(seed=hash((clip_ratio_c, clips)) % 1000)
    logp = token_logprobs(hidden, weight, targets, impl="naive").detach().requires_grad_(True)

    expected_tok, expected_grad = _branch_formula(logp.detach(), old, adv, clip_low, clip_high, clip_ratio_c)
    count = mask.sum().double()
    expected = (expected_tok * mask).sum() / count

    h = hidden.clone().requires_grad_(True)
    loss, stats = _loss(h, weight, targets, old, adv, mask,
                        AlgorithmConfig(clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c))
    torch.testing.assert_close(loss, expected)
    loss.backward()
    h2 = hidden.clone().requires_grad_(True)
    lp2 = token_logprobs(h2, weight, targets, impl="naive")
    (lp2 * (expected_grad * mask / count)).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad)
    assert stats.num_tokens.item() == mask.sum().item()
    assert 0 <= stats.pg_clipfrac_lower.item() <= stats.pg_clipfrac.item() <= stats.num_tokens.item()


def test_clip_branches_all_present():
    # The inputs really exercise every branch: clipped high, clipped low, dual clip, unclipped.
    _, _, _, old, adv, _ = _inputs()
    hidden, weight, targets, *_ = _inputs()
    r = (token_logprobs(hidden, weight, targets, impl="naive") - old).exp()
    assert ((adv > 0) & (r > 1.28)).any() and ((adv < 0) & (r < 0.8)).any()
    assert ((adv < 0) & (r > 3.0)).any() and ((r > 0.8) & (r < 1.28)).any()


def test_fully_masked_batch_gives_zero_loss_and_grads():
    hidden, weight, targets, old, adv, mask = _inputs()
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss, stats = _loss(h, w, targets, old, adv, torch.zeros_like(mask))
    loss.backward()
    assert loss.item() == 0.0 and not torch.isnan(loss)
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0
    assert stats.num_tokens.item() == 0


@pytest.mark.parametrize("splits", [[64], [32, 32], [10, 40, 14]])
def test_normalizer_invariance_over_micro_batches(splits):
    hidden, weight, targets, old, adv, mask = _inputs(seed=3)
    normalizer = mask.sum()
    w = weight.clone().requires_grad_(True)
    start = 0
    total = 0.0
    for size in splits:
        sl = slice(start, start + size)
        loss, _ = _loss(hidden[sl], w, targets[sl], old[sl], adv[sl], mask[sl], normalizer=normalizer)
        loss.backward()
        total += loss.item()
        start += size
    w_ref = weight.clone().requires_grad_(True)
    loss_ref, _ = _loss(hidden, w_ref, targets, old, adv, mask)
    loss_ref.backward()
    assert total == pytest.approx(loss_ref.item(), rel=1e-12)
    torch.testing.assert_close(w.grad, w_ref.grad)


@pytest.mark.parametrize("overlong_buffer", [True, False])
def test_shaped_scores_add_the_penalty_only_when_enabled(overlong_buffer):
    algo = AlgorithmConfig(overlong_buffer=overlong_buffer, overlong_buffer_len=4, overlong_penalty_factor=0.5)
    got = shaped_scores(torch.tensor([1.0, -1.0, -1.0]), torch.tensor([10, 18, 25]), 20, algo)
    expected = [1.0, -1.25, -1.5] if overlong_buffer else [1.0, -1.0, -1.0]
    assert got.dtype == torch.float32 and got.tolist() == expected


def test_response_loss_mask_drops_truncated_only_under_overlong_filter():
    truncated = torch.tensor([False, True, False])
    assert response_loss_mask(truncated, AlgorithmConfig(overlong_filter=True)).tolist() == [True, False, True]
    assert response_loss_mask(truncated, AlgorithmConfig(overlong_filter=False)).tolist() == [True, True, True]


# The clip regions, counted on a batch written out by hand: (advantage, ratio, mask, old probability).
# eps_low 0.2, eps_high 0.28, c 10: upper = A > 0 and r > 1.28; lower = A < 0 and r < 0.8; dual = A < 0 and
# r > 10. Masked tokens count nowhere, whatever their ratio.
CLIP_CASE = [
    (+1.0, 1.50, True, 0.20),   # upper
    (+0.5, 1.29, True, 0.40),   # upper (just past 1 + eps_high)
    (+1.0, 1.10, True, 0.50),   # inside the band
    (+1.0, 0.50, True, 0.50),   # A > 0 and a low ratio: the unclipped branch is the max, not clipped
    (-1.0, 0.50, True, 0.50),   # lower
    (-0.3, 0.79, True, 0.50),   # lower (just below 1 - eps_low)
    (-1.0, 0.90, True, 0.50),   # inside the band
    (-1.0, 2.00, True, 0.10),   # A < 0 and a high ratio below c: unclipped, not clipped
    (-1.0, 12.0, True, 0.01),   # dual
    (-2.0, 50.0, True, 0.01),   # dual
    (0.00, 3.00, True, 0.10),   # A = 0: no branch is active
    (+1.0, 3.00, False, 0.10),  # masked: would be upper
    (-1.0, 20.0, False, 0.01),  # masked: would be dual
    (-1.0, 0.10, False, 0.50),  # masked: would be lower
]


def _clip_case():
    adv, ratio, mask, old_prob = (torch.tensor(col, dtype=torch.float64) for col in zip(*CLIP_CASE))
    old = old_prob.log()
    return old + ratio.log(), old, adv, mask.bool()


def test_clip_fractions_by_region_on_a_hand_computed_batch():
    logp, old, adv, mask = _clip_case()
    _, stats = token_loss(logp, old, adv, mask, AlgorithmConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=10.0))
    assert stats.num_tokens.item() == 11
    assert (stats.clip_upper.item(), stats.clip_lower.item(), stats.clip_dual.item()) == (2, 2, 2)
    # The existing verl names: either side (all three regions) and the dual clip alone.
    assert stats.pg_clipfrac.item() == 6 and stats.pg_clipfrac_lower.item() == 2
    means = stats.means()
    assert means["clip_upper"] == means["clip_lower"] == means["clip_dual"] == pytest.approx(2 / 11)
    assert means["upclip_old_prob"] == pytest.approx((0.20 + 0.40) / 2, rel=1e-12)


def test_up_clipped_tail_share_on_a_hand_computed_batch():
    """The share of up-clipped tokens whose current probability is below exp(-H) at their position."""
    logp, old, adv, mask = _clip_case()
    entropy = torch.full_like(logp, 0.05)
    entropy[0] = 0.5  # upper, new probability 0.30: log 0.30 + 0.5 = -0.70 < 0, in the tail
    entropy[1] = 1.0  # upper, new probability 0.516: log 0.516 + 1.0 = +0.34, not in the tail
    entropy[2] = 0.1  # inside the band (new probability 0.55): in the tail, but not up-clipped
    entropy[11] = 0.5  # masked would-be upper (new probability 0.30): in the tail, but masked
    algo = AlgorithmConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=10.0)
    _, stats = token_loss(logp, old, adv, mask, algo, entropy=entropy)
    assert stats.clip_upper.item() == 2 and stats.upclip_tail.item() == 1
    assert stats.means()["upclip_tail"] == pytest.approx(0.5)
    entropy[1] = 0.6  # now log 0.516 + 0.6 = -0.06: in the tail too
    _, stats = token_loss(logp, old, adv, mask, algo, entropy=entropy)
    assert stats.means()["upclip_tail"] == pytest.approx(1.0)
    _, stats = token_loss(logp, old, adv, mask, AlgorithmConfig(clip_high=5.0), entropy=entropy)
    assert stats.clip_upper.item() == 0 and "upclip_tail" not in stats.means()


def test_clip_fractions_without_dual_clip_count_no_dual():
    logp, old, adv, mask = _clip_case()
    _, stats = token_loss(logp, old, adv, mask, AlgorithmConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=None))
    # Without the dual clip, A < 0 and r > 10 sits in the unclipped branch (the loss grows with r).
    assert (stats.clip_upper.item(), stats.clip_lower.item(), stats.clip_dual.item()) == (2, 2, 0)
    assert stats.pg_clipfrac.item() == 4 and stats.pg_clipfrac_lower.item() == 0


def test_clip_higher_bound_moves_the_upper_count():
    logp, old, adv, mask = _clip_case()
    _, stats = token_loss(logp, old, adv, mask, AlgorithmConfig(clip_low=0.2, clip_high=0.05, clip_ratio_c=10.0))
    assert stats.clip_upper.item() == 3  # 1.10 is now above 1 + eps_high too
    assert stats.clip_lower.item() == 2 and stats.clip_dual.item() == 2
    assert stats.means()["upclip_old_prob"] == pytest.approx((0.20 + 0.40 + 0.50) / 3, rel=1e-12)


def test_no_up_clipped_token_reports_no_upclip_probability():
    logp, old, adv, mask = _clip_case()
    _, stats = token_loss(logp, old, adv, mask, AlgorithmConfig(clip_high=5.0))
    assert stats.clip_upper.item() == 0 and "upclip_old_prob" not in stats.means()
    _, on_policy = token_loss(logp, None, adv, mask, AlgorithmConfig())
    assert on_policy.clip_upper.item() == on_policy.clip_lower.item() == on_policy.clip_dual.item() == 0


def test_entropy_split_by_correct_and_wrong_responses():
    logp, old, adv, mask = _clip_case()
    entropy = torch.arange(len(logp), dtype=torch.float64) + 1.0
    correct = torch.zeros(len(logp), dtype=torch.bool)
    correct[:4] = True  # tokens 0..3 belong to a correct response, the rest to wrong ones
    _, stats = token_loss(logp, old, adv, mask, AlgorithmConfig(), entropy=entropy, correct=correct)
    means = stats.means()
    assert stats.tokens_correct.item() == 4 and stats.tokens_wrong.item() == 7  # 3 of the wrong are masked
    assert means["entropy_correct"] == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert means["entropy_wrong"] == pytest.approx(sum(range(5, 12)) / 7)
    assert means["entropy"] == pytest.approx(sum(range(1, 12)) / 11)
    _, unknown = token_loss(logp, old, adv, mask, AlgorithmConfig(), entropy=entropy)
    assert "entropy_correct" not in unknown.means() and "entropy_wrong" not in unknown.means()

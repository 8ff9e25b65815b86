"""The reference DAPO loss (impl="naive") against an independent float64 formula, branch by branch."""

import pytest
import torch

from flashdapo.kernels import dapo_loss, token_logprobs


def _branch_formula(logp, old, adv, clip_low, clip_high, c):
    """Per-token loss and d loss / d logp written out case by case (DAPO.md section 1)."""
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
    loss, stats = dapo_loss(h, weight, targets, old, adv, mask, clip_low=clip_low, clip_high=clip_high,
                            clip_ratio_c=clip_ratio_c, impl="naive")
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
    loss, stats = dapo_loss(h, w, targets, old, adv, torch.zeros_like(mask), impl="naive")
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
        loss, _ = dapo_loss(hidden[sl], w, targets[sl], old[sl], adv[sl], mask[sl], normalizer=normalizer,
                            impl="naive")
        loss.backward()
        total += loss.item()
        start += size
    w_ref = weight.clone().requires_grad_(True)
    loss_ref, _ = dapo_loss(hidden, w_ref, targets, old, adv, mask, impl="naive")
    loss_ref.backward()
    assert total == pytest.approx(loss_ref.item(), rel=1e-12)
    torch.testing.assert_close(w.grad, w_ref.grad)

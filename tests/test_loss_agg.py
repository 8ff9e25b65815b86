"""Loss aggregation modes: each against a float64 formula over a whole mini-batch, and the same gradient for
any split of the mini-batch into micro-batches (the 1-vs-N-ranks case runs under torchrun in
tests/trainer/test_distributed.py)."""

import pytest
import torch

from flashdapo.algorithm import loss_normalizers, token_loss
from flashdapo.config import AlgorithmConfig
from flashdapo.trainer.batch import mini_batch_normalizers

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-mean-per-micro-batch"]


def _mini_batch(seed=0):
    """A mini-batch of 11 responses of odd lengths; two of them fully masked, some tokens masked elsewhere."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 9, 3, 7, 2, 6, 4, 8, 3, 5])
    n = int(lengths.sum())
    logp = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    old = logp + torch.empty(n, dtype=torch.float64).uniform_(-0.4, 0.4, generator=g)
    adv = torch.repeat_interleave(torch.randn(len(lengths), generator=g, dtype=torch.float64), lengths)
    mask = torch.rand(n, generator=g) > 0.15
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    mask[(owner == 3) | (owner == 6)] = False
    return lengths, logp, old, adv, mask, owner


def _surrogate(logp, old, adv, algo):
    r = torch.exp(logp - old)
    loss = torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - algo.clip_low, 1 + algo.clip_high))
    return torch.where(adv < 0, torch.minimum(loss, -adv * algo.clip_ratio_c), loss)


def _formula(mode, lengths, token_losses, mask, owner, micro):
    """float64, from the definitions: per-response token sums and counts, then the mode's mean."""
    sums = [token_losses[(owner == s) & mask].sum() for s in range(len(lengths))]
    counts = [int(((owner == s) & mask).sum()) for s in range(len(lengths))]
    live = [s for s in range(len(lengths)) if counts[s] > 0]
    if mode == "token-mean":
        return sum(sums) / sum(counts)
    if mode == "seq-mean-token-mean":
        return sum(sums[s] / counts[s] for s in live) / len(live)
    if mode == "seq-mean-token-sum":
        return sum(sums[s] for s in live) / len(live)
    total = 0.0  # the released recipe's per-micro-batch token mean, weighted by the micro-batch's share
    for start in range(0, len(lengths), micro):
        chunk = range(start, min(start + micro, len(lengths)))
        tokens = sum(counts[s] for s in chunk)
        if tokens:
            total = total + sum(sums[s] for s in chunk) / tokens * sum(counts[s] > 0 for s in chunk) / len(live)
    return total


@pytest.mark.parametrize("micro", [1, 3, 4, 100])
@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_float64_formula(mode, micro):
    lengths, logp, old, adv, mask, owner = _mini_batch(seed=micro)
    algo = AlgorithmConfig(loss_agg_mode=mode, loss_agg_micro_batch=micro)
    valid_tokens = torch.tensor([int(((owner == s) & mask).sum()) for s in range(len(lengths))])
    normalizers, total = mini_batch_normalizers(valid_tokens, algo)
    assert total == int(mask.sum())
    x = logp.clone().requires_grad_(True)
    loss, _ = token_loss(x, old, adv, mask, algo, normalizer=normalizers[owner])
    loss.backward()
    y = logp.clone().requires_grad_(True)
    want = _formula(mode, lengths, _surrogate(y, old, adv, algo), mask, owner, micro)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)


def test_modes_coincide_where_they_should():
    counts = torch.tensor([4, 0, 7, 2, 5])
    token_mean = loss_normalizers(counts, "token-mean", 4)
    # One micro-batch holding the whole mini-batch is the token mean; micro-batches of one response are the
    # sequence mean of token means.
    torch.testing.assert_close(loss_normalizers(counts, "token-mean-per-micro-batch", 5), token_mean)
    torch.testing.assert_close(loss_normalizers(counts, "token-mean-per-micro-batch", 1),
                               loss_normalizers(counts, "seq-mean-token-mean", 4))
    assert loss_normalizers(counts, "seq-mean-token-sum", 4).tolist() == [4, 1, 4, 4, 4]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits", [[11], [4, 4, 3], [1, 7, 3]])
def test_any_micro_batch_split_gives_the_same_gradient(mode, splits):
    """Micro-batches of whole responses (as the trainer cuts them), in any order: the normalizers come from
    the mini-batch, so the summed gradient is that of the whole mini-batch in one call."""
    lengths, logp, old, adv, mask, owner = _mini_batch(seed=5)
    algo = AlgorithmConfig(loss_agg_mode=mode, loss_agg_micro_batch=3)
    valid_tokens = torch.tensor([int(((owner == s) & mask).sum()) for s in range(len(lengths))])
    normalizers, _ = mini_batch_normalizers(valid_tokens, algo)
    per_token = normalizers[owner]
    whole = logp.clone().requires_grad_(True)
    loss, _ = token_loss(whole, old, adv, mask, algo, normalizer=per_token)
    loss.backward()
    parts = logp.clone().requires_grad_(True)
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(len(splits)))
    total, start = 0.0, 0
    for size in splits:
        rows = torch.isin(owner, order[start:start + size])
        start += size
        part, _ = token_loss(parts[rows], old[rows], adv[rows], mask[rows], algo, normalizer=per_token[rows])
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(parts.grad, whole.grad, rtol=1e-12, atol=1e-15)

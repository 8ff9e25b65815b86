"""The hard cases of docs/kernels.md (numbered as there) for impl="torch" and impl="triton", against float64.

`tiled` is the chunked torch path forced into many small token and vocabulary chunks, so that the
online merge across vocabulary chunks is exercised at these small shapes. On a CPU the Triton kernels
run under TRITON_INTERPRET=1 (tests/kernels/conftest.py) at interpreter-sized shapes; with a GPU the
same cases run the compiled kernels and carry the `cuda` marker. The reference is the naive path on
float64 copies of the very same (dtype-rounded) inputs; the accuracy criterion is in kernel_accuracy.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_accuracy import ON_CUDA, impl_params
from kernel_accuracy import check as _check
from kernel_accuracy import logprobs as _logprobs
from kernel_accuracy import run as _run

from flashdapo.algorithm import token_loss
from flashdapo.config import AlgorithmConfig
from flashdapo.kernels import CHUNKED_IMPLS, token_logprobs
from flashdapo.kernels.naive import naive_token_logprobs

LOSS_IMPLS = impl_params(CHUNKED_IMPLS)
IMPLS = [*LOSS_IMPLS, "tiled"]
INTERP = not ON_CUDA  # triton shapes must stay tiny under the interpreter


def _device(impl: str) -> torch.device:
    return torch.device("cuda" if impl == "triton" and ON_CUDA else "cpu")


def _shape(impl: str) -> tuple[int, int, int]:
    """(N, H, V): V prime and several tiles wide, H not a multiple of 16."""
    return (33, 24, 97) if impl == "triton" and INTERP else (37, 40, 1009)


def _inputs(impl, n, hdim, vocab, dtype=torch.float32, w_scale=0.3):
    h = torch.randn(n, hdim)
    w = torch.randn(vocab, hdim) * w_scale
    y = torch.randint(0, vocab, (n,))
    dev = _device(impl)
    return h.to(dev, dtype), w.to(dev, dtype), y.to(dev)


def _upstream(n, which="both"):
    g = torch.randn(n, dtype=torch.float64) if which in ("both", "logp") else None
    ge = torch.randn(n, dtype=torch.float64) if which in ("both", "entropy") else None
    return g, ge


# 1, 4, 11: prime V, temperatures, random upstream gradients of both signs for logp and entropy.
@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.0, 1.5])
@pytest.mark.parametrize("which", ["both", "logp", "entropy"])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_float64(impl, temperature, which, seed):
    n, hdim, vocab = _shape(impl)
    h, w, y = _inputs(impl, n, hdim, vocab)
    g, ge = _upstream(n, which)
    _check(impl, h, w, y, temperature, g, ge)


# 1, 8: V smaller than one tile / chunk, and all-negative logits (no padded column may enter max/sum).
@pytest.mark.parametrize("vocab", [13, 16, 31])
@pytest.mark.parametrize("impl", IMPLS)
def test_small_vocab(impl, vocab, seed):
    h, w, y = _inputs(impl, 19, 24, vocab)
    _check(impl, h, w, y, 1.0, *_upstream(19))


@pytest.mark.parametrize("impl", IMPLS)
def test_all_negative_logits(impl, seed):
    n, hdim, vocab = _shape(impl)
    h, w, y = _inputs(impl, n, hdim, vocab)
    h, w = h.abs() + 0.1, -(w.abs() + 0.05)
    assert ((h.double() @ w.double().T) < 0).all()
    logp, ent, _, _ = _check(impl, h, w, y, 1.0, *_upstream(n))
    assert (logp <= 0).all() and (ent >= 0).all()


# 2: huge logits at T = 0.05 (near one-hot rows).
@pytest.mark.parametrize("impl", IMPLS)
def test_sharp_temperature(impl, seed):
    n, hdim, vocab = _shape(impl)
    h, w, y = _inputs(impl, n, hdim, vocab, w_scale=1.0)
    logp, ent, dh, dw = _check(impl, h, w, y, 0.05, *_upstream(n))
    assert (logp <= 0).all() and (ent >= 0).all()
    assert ent.min().item() < 1e-3, "the case should contain near one-hot rows"


# 3: W = 0: logp = -log V, entropy = log V, zero entropy gradient.
@pytest.mark.parametrize("impl", IMPLS)
def test_zero_weight(impl, seed):
    n, hdim, vocab = _shape(impl)
    h, w, y = _inputs(impl, n, hdim, vocab)
    w = torch.zeros_like(w)
    g, ge = _upstream(n)
    logp, ent, dh, dw = _run(impl, h, w, y, 0.7, None, ge)
    log_v = torch.tensor(math.log(vocab), dtype=torch.float32).double()
    torch.testing.assert_close(logp, -log_v.expand(n), rtol=2.0**-23, atol=0)  # fp32 rounding of log V
    torch.testing.assert_close(ent, log_v.expand(n), rtol=2.0**-23, atol=0)
    assert (dh == 0).all() and (dw == 0).all(), "entropy is flat in W at W = 0 (and in h)"
    _check(impl, h, w, y, 0.7, g, ge)


# 5: DAPO branches through the kernels' boundary: log-probs from `impl`, the loss composed on them.
def dapo_loss(h, w, y, old, adv, mask, *, impl, clip_low=0.2, clip_high=0.28, clip_ratio_c=10.0, temperature=1.0,
              normalizer=None):
    """The trainer's composition: per-token log-probs and entropy from `impl`, then the DAPO token loss."""
    logp, entropy = token_logprobs(h, w, y, temperature=temperature, with_entropy=True, impl=impl)
    algo = AlgorithmConfig(clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c)
    return token_loss(logp, old, adv, mask, algo, normalizer=normalizer, entropy=entropy.detach())


def _dapo_inputs(impl, n, hdim, vocab, clip_low, clip_high, c):
    h, w, y = _inputs(impl, n, hdim, vocab)
    logp = naive_token_logprobs(h.double().cpu(), w.double().cpu(), y.cpu())[0]
    # log-uniform ratios in [0.3, 4], kept 1e-3 away from every clip boundary so that fp32 rounding of
    # logp cannot flip a branch; advantages of both signs.
    ratio = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(0.3), math.log(4.0)))
    for edge in (1 - clip_low, 1 + clip_high, c or 0.0):
        near = (ratio - edge).abs() < 1e-3
        ratio[near] = edge + 2e-3
    adv = torch.randn(n, dtype=torch.float64) * 2
    mask = torch.rand(n) > 0.2
    dev = h.device
    return h, w, y, (logp - ratio.log()).to(dev), adv.to(dev), mask.to(dev), ratio, adv, mask


def _loss_and_grads(impl, h, w, y, old, adv, mask, **kw):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    loss, stats = dapo_loss(h, w, y, old, adv, mask, impl=impl, **kw)
    loss.backward()
    return loss.detach().double().cpu(), h.grad.double().cpu(), w.grad.double().cpu(), stats


@pytest.mark.parametrize("clips", [(0.2, 0.28, 10.0), (0.2, 0.28, None), (0.1, 0.5, 3.0)])
@pytest.mark.parametrize("impl", LOSS_IMPLS)
def test_dapo_branches(impl, clips, seed):
    clip_low, clip_high, c = clips
    n, hdim, vocab = _shape(impl)
    n = 2 * n
    h, w, y, old, adv, mask, ratio, a, m = _dapo_inputs(impl, n, hdim, vocab, clip_low, clip_high, c)
    kw = dict(clip_low=clip_low, clip_high=clip_high, clip_ratio_c=c, temperature=1.0)
    loss, dh, dw, stats = _loss_and_grads(impl, h, w, y, old, adv, mask, **kw)
    ref_loss, ref_dh, ref_dw, _ = _loss_and_grads("naive", h.double(), w.double(), y, old.double(), adv.double(),
                                                  mask, **kw)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dh, ref_dh, rtol=1e-4, atol=1e-5 * ref_dh.abs().max().item())
    torch.testing.assert_close(dw, ref_dw, rtol=1e-4, atol=1e-5 * ref_dw.abs().max().item())
    clipped = ((a > 0) & (ratio > 1 + clip_high)) | ((a < 0) & (ratio < 1 - clip_low))
    if c is not None:
        clipped |= (a < 0) & (ratio > c)
    dead = clipped | ~m
    assert dead.any() and (~dead).any(), "the case should contain clipped, masked and live tokens"
    assert (dh[dead] == 0).all(), "clipped / masked tokens must have exactly zero gradient"
    assert (dh[~dead].abs().sum(1) > 0).all()
    assert stats.pg_clipfrac.item() == (clipped & m).sum().item()


# 6: masks.
@pytest.mark.parametrize("impl", LOSS_IMPLS)
def test_fully_masked_sequence_and_batch(impl, seed):
    n, hdim, vocab = _shape(impl)
    h, w, y, old, adv, mask, *_ = _dapo_inputs(impl, n, hdim, vocab, 0.2, 0.28, 10.0)
    mask = torch.ones_like(mask)
    mask[5:15] = False  # one whole sequence of the packed batch
    loss, dh, dw, _ = _loss_and_grads(impl, h, w, y, old, adv, mask)
    assert torch.isfinite(loss) and torch.isfinite(dh).all() and torch.isfinite(dw).all()
    assert (dh[5:15] == 0).all()
    loss, dh, dw, stats = _loss_and_grads(impl, h, w, y, old, adv, torch.zeros_like(mask))
    assert loss.item() == 0.0 and (dh == 0).all() and (dw == 0).all()
    assert stats.num_tokens.item() == 0 and all(math.isfinite(v) for v in stats.means().values())


# 7: the global normalizer makes micro-batch splits irrelevant.
@pytest.mark.parametrize("impl", LOSS_IMPLS)
def test_normalizer_invariance(impl, seed):
    n, hdim, vocab = _shape(impl)
    h, w, y, old, adv, mask, *_ = _dapo_inputs(impl, n, hdim, vocab, 0.2, 0.28, 10.0)
    count = mask.sum()

    def grads(bounds):
        hh = h.detach().clone().requires_grad_(True)
        ww = w.detach().clone().requires_grad_(True)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            loss, _ = dapo_loss(hh[lo:hi], ww, y[lo:hi], old[lo:hi], adv[lo:hi], mask[lo:hi], normalizer=count,
                                impl=impl)
            loss.backward()
        return hh.grad.double().cpu(), ww.grad.double().cpu()

    whole = grads([0, n])
    for bounds in ([0, 13, n], [0, 1, 20, 29, n]):
        for a, b in zip(grads(bounds), whole):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


# 8: ragged shapes.
@pytest.mark.parametrize("n", [1, 17, pytest.param(1937, marks=pytest.mark.slow)])
@pytest.mark.parametrize("impl", IMPLS)
def test_ragged_shapes(impl, n, seed):
    hdim = 24 if impl == "triton" and INTERP else 130
    _, _, vocab = _shape(impl)
    h, w, y = _inputs(impl, n, hdim, vocab)
    _check(impl, h, w, y, 0.7, *_upstream(n))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch(impl, seed):
    _, hdim, vocab = _shape(impl)
    h, w, y = _inputs(impl, 0, hdim, vocab)
    h.requires_grad_(True)
    w.requires_grad_(True)
    logp, ent = _logprobs(impl, h, w, y)
    assert logp.shape == (0,) and ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert h.grad.shape == h.shape and (w.grad == 0).all()


# 10: determinism and row independence.
@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_and_row_independent(impl, seed):
    n, hdim, vocab = _shape(impl)
    h, w, y = _inputs(impl, n, hdim, vocab)
    g, ge = _upstream(n)
    first, second = _run(impl, h, w, y, 0.7, g, ge), _run(impl, h, w, y, 0.7, g, ge)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "two runs must be bitwise equal"
    h2 = h.clone()
    h2[n // 2 :] = torch.randn_like(h2[n // 2 :]) * 5  # other rows change
    again = _run(impl, h2, w, y, 0.7, g, ge)
    assert torch.equal(again[0][: n // 2], first[0][: n // 2]), "a row's log-prob depends on other rows"
    assert torch.equal(again[2][: n // 2], first[2][: n // 2]), "a row's dh depends on other rows"
    alone = _run(impl, h[:3], w, y[:3], 0.7, g[:3], ge[:3])
    # BLAS may round a 3-row matmul differently from a 37-row one (naive torch does too): the chunk plan
    # and every elementwise pass are per row, so only that rounding may differ.
    torch.testing.assert_close(alone[0], first[0][:3], rtol=0, atol=1e-6)


# 12: input dtypes; fp32 outputs.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [0.05, 0.7])
@pytest.mark.parametrize("impl", IMPLS)
def test_dtypes(impl, dtype, temperature, seed):
    n, hdim, vocab = _shape(impl)
    h, w, y = _inputs(impl, n, hdim, vocab, dtype=dtype)
    h2, w2 = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
    logp, ent = _logprobs(impl, h2, w2, y, temperature)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    (logp.sum() + ent.sum()).backward()
    assert h2.grad.dtype == dtype and w2.grad.dtype == dtype
    _check(impl, h, w, y, temperature, *_upstream(n))


# Skipped rows: zero upstream gradient -> exactly zero dh, and no contribution to dW.
@pytest.mark.parametrize("impl", IMPLS)
def test_zero_gradient_rows_skipped(impl, seed):
    n, hdim, vocab = _shape(impl)
    h, w, y = _inputs(impl, n, hdim, vocab)
    g, ge = _upstream(n)
    dead = torch.rand(n) < 0.5
    g[dead] = 0
    ge[dead] = 0
    _, _, dh, dw = _run(impl, h, w, y, 1.0, g, ge)
    assert (dh[dead] == 0).all() and (dh[~dead] != 0).any()
    live = (~dead).nonzero().squeeze(1)
    _, _, _, dw_live = _run(impl, h[live.to(h.device)], w, y[live.to(y.device)], 1.0, g[live], ge[live])
    torch.testing.assert_close(dw, dw_live, rtol=1e-5, atol=1e-6 * dw.abs().max().item())


# Zipfian targets: real text repeats common tokens ~10^3 times a batch; many rows share a few columns.
@pytest.mark.parametrize("impl", IMPLS)
def test_zipfian_targets(impl, seed):
    n, hdim, vocab = _shape(impl)
    n = 3 * n
    h, w, _ = _inputs(impl, n, hdim, vocab)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.5  # top token ~38% of rows
    y = torch.multinomial(zipf, n, replacement=True).to(h.device)
    assert torch.bincount(y).max().item() >= n // 5, "the case should repeat its top token"
    _check(impl, h, w, y, 0.7, *_upstream(n))


# fp16 at realistic loss-gradient magnitudes: dz = p g with g ~ A / (T normalizer) ~ 1e-6 lies below
# fp16's normal range (6e-5); it must not be flushed before the matmuls (naive computes in fp32).
@pytest.mark.parametrize("impl", LOSS_IMPLS)
def test_fp16_small_gradients(impl, seed):
    n, hdim, vocab = _shape(impl)
    h, w, y = _inputs(impl, n, hdim, vocab, dtype=torch.float16)
    g, ge = _upstream(n)
    _, _, dh, _ = _check(impl, h, w, y, 1.0, g * 1e-6, ge * 1e-7)
    assert (dh.abs().sum(1) > 0).all(), "a row's gradient was flushed to zero"

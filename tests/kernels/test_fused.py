"""The fused sweep (log-probs and a per-token loss's gradient in one pass) against the generic composition:
naive log-probs in float64, then the DAPO token loss on them."""

from __future__ import annotations

import pytest
import torch
from kernel_accuracy import ON_CUDA, TRITON_MARKS, impl_params
from kernel_accuracy import check as accuracy_check
from kernel_accuracy import reference as float64_reference
from kernel_accuracy import run as run_impl

from flashdapo.algorithm import token_loss
from flashdapo.config import AlgorithmConfig
from flashdapo.kernels import CHUNKED_IMPLS, token_logprobs
from flashdapo.kernels.fused import fused_token_loss

IMPLS = impl_params(CHUNKED_IMPLS)
ALGO = AlgorithmConfig()


def _device(impl):
    return torch.device("cuda" if impl == "triton" and torch.cuda.is_available() else "cpu")


def _case(impl, n=53, hdim=24, vocab=97):
    dev = _device(impl)
    h, w = torch.randn(n, hdim), torch.randn(vocab, hdim) * 0.3
    y = torch.randint(0, vocab, (n,))
    logp = token_logprobs(h.double(), w.double(), y, impl="naive")
    old = logp - torch.empty(n, dtype=torch.float64).uniform_(-1.2, 1.4)  # ratios in [0.25, 3.3]
    adv, mask = torch.randn(n, dtype=torch.float64) * 2, torch.rand(n) > 0.25
    return [t.to(dev) for t in (h, w, y, old, adv, mask)]


def _fused(impl, h, w, y, old, adv, mask, temperature=0.7, **kw):
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    norm = mask.sum().double()
    fn = lambda lp, rows: token_loss(lp, old[rows], adv[rows], mask[rows], ALGO, normalizer=norm)[0]  # noqa: E731
    loss, logp, ent = fused_token_loss(hh, ww, y, fn, keep=mask, temperature=temperature, impl=impl, **kw)
    loss.backward()
    return [t.detach().double().cpu() for t in (loss, logp, ent, hh.grad, ww.grad)]


def _reference(h, w, y, old, adv, mask, temperature=0.7):
    hh, ww = h.double().cpu().requires_grad_(True), w.double().cpu().requires_grad_(True)
    logp, ent = token_logprobs(hh, ww, y.cpu(), temperature=temperature, with_entropy=True, impl="naive")
    loss, _ = token_loss(logp, old.cpu(), adv.cpu(), mask.cpu(), ALGO)
    loss.backward()
    return [t.detach() for t in (loss, logp, ent, hh.grad, ww.grad)]


@pytest.mark.parametrize("chunks", [(None, None), (16, 32)])
@pytest.mark.parametrize("impl", IMPLS)
def test_fused_matches_float64_composition(impl, chunks, seed):
    case = _case(impl)
    loss, logp, ent, dh, dw = _fused(impl, *case, chunk_tokens=chunks[0], chunk_vocab=chunks[1])
    ref = _reference(*case)
    mask = case[5].cpu()
    torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp[mask], ref[1][mask], rtol=0, atol=2e-6)
    torch.testing.assert_close(ent[mask], ref[2][mask], rtol=0, atol=2e-6)
    assert (logp[~mask] == 0).all() and (ent[~mask] == 0).all(), "dropped rows come back as 0"
    for got, want in ((dh, ref[3]), (dw, ref[4])):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    assert (dh[~mask] == 0).all()
    dead = (ref[3].abs().sum(1) == 0) & mask
    assert dead.any(), "the case should contain clipped live tokens"
    assert (dh[dead] == 0).all(), "clipped tokens must have exactly zero gradient"


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_deterministic(impl, seed):
    case = _case(impl)
    first, second = _fused(impl, *case, chunk_tokens=16), _fused(impl, *case, chunk_tokens=16)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "two runs must be bitwise equal"


def test_fused_no_grad_and_fully_masked(seed):
    h, w, y, old, adv, mask = _case("torch")
    fn = lambda lp, rows: token_loss(lp, old[rows], adv[rows], mask[rows], ALGO, normalizer=1.0)[0]  # noqa: E731
    with torch.no_grad():
        loss, logp, _ = fused_token_loss(h, w, y, fn, keep=mask)
    assert loss.requires_grad is False and torch.isfinite(logp).all()
    hh = h.clone().requires_grad_(True)
    loss, _, _ = fused_token_loss(hh, w, y, fn, keep=torch.zeros_like(mask))
    loss.backward()
    assert loss.item() == 0.0 and (hh.grad == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", impl_params(CHUNKED_IMPLS))
def test_fused_16bit_inputs_match_float64(impl, dtype, seed):
    """bf16/fp16 inputs: 16-bit dz tiles (the last one narrower than the rest: V = 97), the fp32 dW
    accumulator cast once, dh cast per chunk. fp16 at gradients of ~1e-4 (normal in fp16) whose dz terms
    p g ~ 1e-6 lie below fp16's normal range: the power-of-two scale keeps them, the GEMMs' alpha undoes it."""
    h, w, y, old, adv, mask = _case(impl)
    h, w = h.to(dtype), w.to(dtype)
    small = dtype == torch.float16
    scale = 1e-4 if small else 1.0
    norm = mask.sum().double() / scale
    fn = lambda lp, rows: token_loss(lp, old[rows], adv[rows], mask[rows], ALGO, normalizer=norm)[0]  # noqa: E731
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, _, _ = fused_token_loss(hh, ww, y, fn, keep=mask, temperature=0.7, impl=impl)
    loss.backward()
    assert hh.grad.dtype == dtype and ww.grad.dtype == dtype
    h64, w64 = h.double().cpu().requires_grad_(True), w.double().cpu().requires_grad_(True)
    logp = token_logprobs(h64, w64, y.cpu(), temperature=0.7, impl="naive")
    token_loss(logp, old.cpu(), adv.cpu(), mask.cpu(), ALGO, normalizer=norm.cpu())[0].backward()
    eps = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]  # half an ulp: the final rounding
    for got, want in ((hh.grad, h64.grad), (ww.grad, w64.grad)):
        got, scale_ = got.double().cpu(), want.abs().max().item()
        assert scale_ > 0 and torch.isfinite(got).all()
        assert (got - want).abs().max().item() <= 8 * eps * scale_, (got - want).abs().max().item() / scale_
    assert (hh.grad.cpu()[~mask.cpu()] == 0).all()


# The hard cases of docs/kernels.md through the fused sweep, by the kernels' accuracy criterion
# (kernel_accuracy.py): prime V over several tiles, near one-hot rows at T = 0.05, Zipfian targets,
# all-negative logits. "-tiled" forces 128-column tiles, so rows whose max lies in another tile than the
# target's (the torch path's p = e exp(m_tile - m) / s with m_tile < m) are common.
FUSED_IMPLS = ["fused-torch", "fused-torch-tiled", pytest.param("fused-triton", marks=TRITON_MARKS)]


def _hard_inputs(impl, w_scale=0.3):
    n, hdim, vocab = (33, 24, 97) if "triton" in impl and not ON_CUDA else (37, 40, 1009)
    dev = torch.device("cuda" if "triton" in impl and ON_CUDA else "cpu")
    h, w = torch.randn(n, hdim), torch.randn(vocab, hdim) * w_scale
    return h.to(dev), w.to(dev), torch.randint(0, vocab, (n,)).to(dev), torch.randn(n, dtype=torch.float64)


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.5])
@pytest.mark.parametrize("impl", FUSED_IMPLS)
def test_fused_hard_cases_match_float64(impl, temperature, seed):
    h, w, y, g = _hard_inputs(impl, w_scale=1.0 if temperature == 0.05 else 0.3)
    logp, ent, _, _ = accuracy_check(impl, h, w, y, temperature, g, None)
    assert (logp <= 0).all() and (ent >= 0).all()
    if temperature == 0.05:
        assert ent.min().item() < 1e-3, "the case should contain near one-hot rows"


@pytest.mark.parametrize("impl", FUSED_IMPLS)
def test_fused_zipfian_and_negative_logits(impl, seed):
    h, w, _, g = _hard_inputs(impl)
    zipf = 1.0 / torch.arange(1, w.shape[0] + 1, dtype=torch.float64) ** 1.5  # top token ~38% of rows
    y = torch.multinomial(zipf, len(g), replacement=True).to(h.device)
    assert torch.bincount(y).max().item() >= len(g) // 5, "the case should repeat its top token"
    accuracy_check(impl, h, w, y, 0.7, g, None)
    h, w = h.abs() + 0.1, -(w.abs() + 0.05)
    logp, ent, _, _ = accuracy_check(impl, h, w, y, 1.0, g, None)
    assert (logp <= 0).all() and (ent >= 0).all()


def test_fused_float64_inputs(seed):
    """fp64 inputs keep fp64 tiles, statistics and gradients (tiles kept as e there too)."""
    h, w, y, g = _hard_inputs("fused-torch")
    got = run_impl("fused-torch-tiled", h.double(), w.double(), y, 0.7, g, None)
    ref = float64_reference(h, w, y, 0.7, g, None)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)

"""Final-logit softcapping (Gemma: logits c tanh(h W^T / c) / T) in every LM-head path, against float64.

Every impl (the chunked torch path, the same forced into 8 x 128 tiles, the Triton passes, the fused sweep
on torch and Triton tiles, 128-column tiles too) is held to the accuracy criterion of kernel_accuracy.py
(naive torch's own error in the same dtype + 2 eps at the problem's scale), with the capped logits'
scale and the capped gradients' term sizes. Inputs are fresh per seed (conftest.py) at odd shapes: N odd,
V prime (97 under the interpreter: 4 tiles of 32 columns, the last one column wide, not a multiple of
BLOCK_V; else 1009), with the hard cases of docs/kernels.md planted in each: every fifth target at the
vocabulary's last column, masked rows (zero upstream gradient; `masked_rows`), and an all-negative case.

Regimes: `saturated` (caps 0.5-5 against logits of magnitude 10-50: most logits deep in tanh's flat
part, sech^2 down to 1e-40 and below) and `linear` (caps 30 and 100 against logits up to ~20), each
at its own temperature (0.5-1.5), log-prob, entropy and both gradients (upstream gradients of both signs
for log-prob and entropy on the generic path; the fused sweep takes a per-token loss of the log-probs).
Set FLASHDAPO_SOFTCAP_REPORT=<file> to append every measured error as a JSON line.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from kernel_accuracy import (
    ON_CUDA,
    TRITON_MARKS,
    cap_rounding_terms,
    capped_logits,
    check,
    impl_params,
    reference,
)

from flashdapo.algorithm import token_loss
from flashdapo.config import AlgorithmConfig
from flashdapo.kernels import CHUNKED_IMPLS, token_logprobs, token_probe_stats
from flashdapo.kernels import fused_token_loss as api_fused_token_loss
from flashdapo.kernels.chunked import chunked_token_logprobs
from flashdapo.kernels.fused import fused_token_loss
from flashdapo.kernels.softcap import normalize_softcap

INTERP = not ON_CUDA
IMPL_PARAMS = ["torch", "tiled", pytest.param("triton", marks=TRITON_MARKS), "fused-torch", "fused-torch-tiled",
               pytest.param("fused-triton", marks=TRITON_MARKS)]
# (regime, cap, temperature): where tanh saturates and where it is nearly linear, several temperatures.
CASES = [("saturated", 0.5, 0.7), ("saturated", 2.0, 1.0), ("saturated", 5.0, 1.5), ("linear", 30.0, 0.5),
         ("linear", 100.0, 1.0), ("negative", 2.0, 0.7)]
CASE_IDS = [f"{r}-c{c:g}-T{t:g}" for r, c, t in CASES]
LOGIT_STD = {"saturated": 12.0, "linear": 4.0}  # std of h W^T: max |logit| ~ 40-60 / ~15-20


def _device(impl) -> torch.device:
    return torch.device("cuda" if "triton" in str(impl) and ON_CUDA else "cpu")


def _shape(impl) -> tuple[int, int, int]:
    """(N, H, V): N odd, V prime; interpreter-sized for Triton on a CPU."""
    return (33, 24, 97) if "triton" in str(impl) and INTERP else (37, 40, 1009)


def _inputs(impl, regime, dtype=torch.float32):
    """h, w, y on the impl's device and g, ge (float64, CPU) with the planted hard cases."""
    n, hdim, vocab = _shape(impl)
    h = torch.randn(n, hdim)
    w = torch.randn(vocab, hdim) * (LOGIT_STD.get(regime, 1.0) / math.sqrt(hdim))
    if regime == "negative":  # every logit < 0: no padded column may enter a max or a sum
        h, w = h.abs() + 0.1, -(w.abs() * 0.3 + 0.05)
    y = torch.randint(0, vocab, (n,))
    y[::5] = vocab - 1  # targets at the vocabulary's last column (the last tile, one column wide at V = 97)
    g, ge = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    g[masked_rows(impl, n)] = ge[masked_rows(impl, n)] = 0.0  # zero upstream gradient: dropped before any matmul
    dev = _device(impl)
    return h.to(dev, dtype), w.to(dev, dtype), y.to(dev), g, ge


def masked_rows(impl, n: int) -> slice:
    """Rows with zero upstream gradient: every fourth row, except on the generic path's multi-tile plans
    ("tiled": 8-row tiles; Triton under the interpreter: 16), where they are a trailing block from a tile
    boundary. There the backward compacts the live rows into its own recompute tiles, and a row that moves
    to another place in a tile may get its logits rounded differently by BLAS than in the forward (a limit
    of the generic path with or without a cap, reported with this change): at near one-hot rows
    (c / T = 60) that alone cost up to 5x naive's dh error. The fused sweep has no recompute."""
    tile = {"tiled": 8, "triton": 16 if INTERP else n}.get(str(impl))
    start = tile * int(0.75 * n // tile) if tile else 0
    return slice(start, n) if start else slice(1, n, 4)


def _assert_regime(h, w, regime, cap):
    x = (h.double() @ w.double().T).abs()
    if regime == "saturated":
        assert 10 <= x.max().item() <= 100, x.max().item()
        assert (x / cap > 2).double().mean().item() > 0.3, "many logits should lie where tanh saturates"
    elif regime == "linear":
        assert x.max().item() / cap < 0.85, "tanh should be nearly linear here"
    else:
        assert ((h.double() @ w.double().T) < 0).all()


def _record(test, impl, case, dtype, report):
    path = os.environ.get("FLASHDAPO_SOFTCAP_REPORT")
    if path:
        with open(path, "a") as f:
            for row in report:
                f.write(json.dumps({"test": test, "impl": str(impl), "case": case, "dtype": str(dtype), **row}) + "\n")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_softcap_matches_float64(impl, case, seed):
    """fp32: log-prob, entropy, dh, dW against float64 by the kernels' criterion."""
    regime, cap, temperature = case
    h, w, y, g, ge = _inputs(impl, regime)
    _assert_regime(h, w, regime, cap)
    if impl.startswith("fused"):
        ge = None  # the fused sweep takes a per-token loss of the log-probs
    report = []
    logp, ent, dh, dw = check(impl, h, w, y, temperature, g, ge, softcap=cap, report=report)
    _record("fp32", impl, case, torch.float32, report)
    assert (logp <= 0).all() and (ent >= 0).all()
    assert (dh[masked_rows(impl, len(y))] == 0).all(), "masked rows must get exactly zero gradient"
    # the capped logits lie in (-c/T, c/T): log p >= -2c/T - log V
    assert (logp >= -2 * cap / temperature - math.log(w.shape[0]) - 1e-4).all()


FP16_CASES = [CASES[1], CASES[3]]


@pytest.mark.parametrize("case", FP16_CASES, ids=[CASE_IDS[1], CASE_IDS[3]])
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=TRITON_MARKS),
                                  pytest.param("fused-triton", marks=TRITON_MARKS)])
def test_softcap_fp16_matches_float64(impl, case, seed):
    """fp16 inputs (Triton: fp16 operands, 16-bit dz tiles, fp16 gradients) against float64."""
    regime, cap, temperature = case
    h, w, y, g, ge = _inputs(impl, regime, torch.float16)
    report = []
    check(impl, h, w, y, temperature, g, None if impl.startswith("fused") else ge, softcap=cap, report=report)
    _record("fp16", impl, case, torch.float16, report)


def _wide_triton(h, w, y, temperature, softcap):
    """Triton passes on tiles several BLOCK_V steps wide (one tile of the whole vocabulary), 16-row tiles."""
    return chunked_token_logprobs(h, w, y, temperature, True, impl="triton", chunk_tokens=16,
                                  chunk_vocab=w.shape[0], softcap=softcap)


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=TRITON_MARKS)])
def test_softcap_triton_multi_step_tiles(impl, seed):
    """The Triton passes' in-tile loop over BLOCK_V steps (3 steps, the last one partly padded) with a cap."""
    from flashdapo.kernels.triton_tiles import config

    block_v = config().block_v
    vocab = 2 * block_v + 11  # a prime under the interpreter (139)
    n, hdim = 21, 20
    h, w = torch.randn(n, hdim), torch.randn(vocab, hdim) * (LOGIT_STD["saturated"] / math.sqrt(hdim))
    y = torch.randint(0, vocab, (n,))
    y[::5] = vocab - 1
    g, ge = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    g[1::4] = ge[1::4] = 0.0
    dev = _device(impl)
    report = []
    check(_wide_triton, h.to(dev), w.to(dev), y.to(dev), 0.7, g, ge, softcap=2.0, report=report)
    _record("multi-step", impl, ("saturated", 2.0, 0.7), torch.float32, report)


@pytest.mark.parametrize("impl", impl_params(("naive", "torch", "triton")))
def test_softcap_off_is_todays_path(impl, seed):
    """softcap None, 0 and absent give the same bits (the off path runs exactly the ops it ran before), through
    token_logprobs (both gradients), token_probe_stats and fused_token_loss."""
    n, hdim, vocab = (19, 16, 37)
    dev = _device(impl)
    h, w = torch.randn(n, hdim, device=dev), torch.randn(vocab, hdim, device=dev) * 0.5
    y = torch.randint(0, vocab, (n,), device=dev)
    outs = []
    for kw in ({}, {"softcap": None}, {"softcap": 0}, {"softcap": 0.0}):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        logp, ent = token_logprobs(hh, ww, y, temperature=0.7, with_entropy=True, impl=impl, **kw)
        (logp.sum() + 0.5 * ent.sum()).backward()
        out = [logp, ent, hh.grad, ww.grad, *token_probe_stats(h, w, y, temperature=0.7, impl=impl, **kw)]
        if impl in CHUNKED_IMPLS:
            hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
            loss, flp, fent = api_fused_token_loss(hh, ww, y, lambda lp, rows: lp.sum(), temperature=0.7,
                                                   impl=impl, **kw)
            loss.backward()
            out += [loss, flp, fent, hh.grad, ww.grad]
        outs.append(out)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_softcap_validation():
    assert normalize_softcap(None) is None and normalize_softcap(0) is None and normalize_softcap(30) == 30.0
    h, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            token_logprobs(h, w, y, softcap=bad)
        with pytest.raises(ValueError, match="softcap"):
            token_probe_stats(h, w, y, softcap=bad)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=TRITON_MARKS)])
def test_softcap_probe_stats(impl, seed):
    """token_probe_stats with a cap: logp, entropy and the top-1 probability 1 / s against float64."""
    h, w, y, _, _ = _inputs(impl, "saturated")
    cap, temperature = 2.0, 0.7
    got = token_probe_stats(h, w, y, temperature=temperature, impl=impl, softcap=cap)
    z = capped_logits(h.cpu(), w.cpu(), temperature, cap)
    logp_all = torch.log_softmax(z, dim=1)
    want = (logp_all.gather(1, y.cpu().long().unsqueeze(1)).squeeze(1), -(logp_all.exp() * logp_all).sum(1),
            logp_all.amax(1).exp())
    eps = 2.0**-23
    tol = 8 * eps * max(1.0, z.abs().max().item(), math.log(w.shape[0]))
    tol += eps * cap_rounding_terms(h.cpu(), w.cpu(), y.cpu(), temperature, None, None, cap)[0]
    for a, b in zip(got, want):
        assert (a.double().cpu() - b).abs().max().item() <= tol


def test_softcap_gradcheck_float64(seed):
    """float64 gradcheck of the chunked torch path (several vocabulary chunks), and central differences of the
    fused sweep (its gradients are handed on once: no gradcheck), with a cap that saturates part of the
    logits: the sech^2 factor of both gradients, the torch fused path's e sech^2 tiles and d_y too."""
    n, hdim, vocab = 7, 5, 23
    h = torch.randn(n, hdim, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(vocab, hdim, dtype=torch.float64) * 2).requires_grad_(True)
    y = torch.randint(0, vocab, (n,))
    y[0] = vocab - 1
    ge = torch.randn(n, dtype=torch.float64)

    def generic(hh, ww):
        logp, ent = chunked_token_logprobs(hh, ww, y, 0.7, True, chunk_tokens=3, chunk_vocab=8, softcap=1.5)
        return logp, ent * ge

    def fused(hh, ww):
        return fused_token_loss(hh, ww, y, lambda lp, rows: (lp * ge[rows]).sum(), temperature=0.7,
                                chunk_tokens=3, chunk_vocab=8, softcap=1.5)[0]

    assert torch.autograd.gradcheck(generic, (h, w))
    fused(h, w).backward()
    eps = 1e-6
    with torch.no_grad():
        for _ in range(4):
            vh, vw = torch.randn_like(h), torch.randn_like(w)
            slope = (fused(h + eps * vh, w + eps * vw) - fused(h - eps * vh, w - eps * vw)) / (2 * eps)
            exact = (h.grad * vh).sum() + (w.grad * vw).sum()
            assert abs(slope.item() - exact.item()) <= 1e-7 * max(1.0, abs(exact.item())), (slope, exact)


ALGO = AlgorithmConfig()


@pytest.mark.parametrize("cap", [2.0, 30.0])
@pytest.mark.parametrize("impl", impl_params(CHUNKED_IMPLS))
def test_softcap_fused_dapo_loss(impl, cap, seed):
    """The fused DAPO token loss with a cap (keep mask, clipped tokens, Zipf-free random advantages) against
    the float64 composition: naive capped log-probs, then flashdapo.algorithm.token_loss."""
    n, hdim, vocab = _shape(impl)
    dev = _device(impl)
    h, w = torch.randn(n, hdim), torch.randn(vocab, hdim) * (8.0 / math.sqrt(hdim))
    y = torch.randint(0, vocab, (n,))
    y[::5] = vocab - 1
    logp64 = token_logprobs(h.double(), w.double(), y, temperature=0.7, impl="naive", softcap=cap)
    old = logp64 - torch.empty(n, dtype=torch.float64).uniform_(-1.2, 1.4)
    adv, mask = torch.randn(n, dtype=torch.float64) * 2, torch.rand(n) > 0.25
    norm = mask.sum().double()
    h, w, y, old_d, adv_d, mask_d = (t.to(dev) for t in (h, w, y, old, adv, mask))
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    fn = lambda lp, rows: token_loss(lp, old_d[rows], adv_d[rows], mask_d[rows], ALGO, normalizer=norm)[0]  # noqa: E731
    loss, logp, ent = fused_token_loss(hh, ww, y, fn, keep=mask_d, temperature=0.7, impl=impl, softcap=cap)
    loss.backward()
    h64, w64 = h.double().cpu().requires_grad_(True), w.double().cpu().requires_grad_(True)
    rlogp, rent = token_logprobs(h64, w64, y.cpu(), temperature=0.7, with_entropy=True, impl="naive", softcap=cap)
    rloss, _ = token_loss(rlogp, old, adv, mask, ALGO)
    rloss.backward()
    scale = max(1.0, (h.double() @ w.double().T).abs().max().item() / 0.7)  # the raw logits' rounding
    weight = (adv.abs() * (rlogp.detach() - old).exp())[mask].sum().item() / norm.item()  # d loss / d logp, summed
    torch.testing.assert_close(loss.double().cpu(), rloss.detach(), rtol=1e-5, atol=4e-7 * scale * weight)
    torch.testing.assert_close(logp.double().cpu()[mask], rlogp.detach()[mask], rtol=0, atol=4e-7 * scale)
    torch.testing.assert_close(ent.double().cpu()[mask], rent.detach()[mask], rtol=0, atol=4e-7 * scale)
    for got, want in ((hh.grad, h64.grad), (ww.grad, w64.grad)):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    assert (hh.grad.cpu()[~mask] == 0).all()
    _record("fused-dapo", impl, ("dapo", cap, 0.7), torch.float32, [
        {"name": "loss", "err": abs(loss.item() - rloss.item())},
        {"name": "dh", "err": (hh.grad.double().cpu() - h64.grad).abs().max().item(),
         "scale": h64.grad.abs().max().item()},
        {"name": "dW", "err": (ww.grad.double().cpu() - w64.grad).abs().max().item(),
         "scale": w64.grad.abs().max().item()}])


def test_reference_is_float64_of_capped_logits(seed):
    """The float64 reference the criterion uses caps before the temperature (HF's and vLLM's order)."""
    h, w, y = torch.randn(9, 6), torch.randn(11, 6) * 4, torch.randint(0, 11, (9,))
    logp = reference(h, w, y, 0.7, torch.ones(9), None, softcap=3.0)[0]
    x = h.double() @ w.double().T
    want = torch.log_softmax(3.0 * torch.tanh(x / 3.0) / 0.7, dim=1).gather(1, y.unsqueeze(1)).squeeze(1)
    assert torch.allclose(logp, want, rtol=0, atol=1e-13)
    wrong = torch.log_softmax(3.0 * torch.tanh(x / 0.7 / 3.0), dim=1).gather(1, y.unsqueeze(1)).squeeze(1)
    assert not torch.allclose(logp, wrong, atol=1e-3), "temperature before the cap is another distribution"

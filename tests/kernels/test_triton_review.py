"""Checks from the review of the compiled Triton kernels: target validation, mixed input dtypes.

On a CPU the kernels run under TRITON_INTERPRET=1 (conftest.py), so the shapes stay tiny.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N, H, V = 19, 24, 37


def _tl():
    from flashdapo.kernels import triton_logprobs

    return triton_logprobs


def _inputs(dtype=torch.float32):
    h = torch.randn(N, H).to(DEV, dtype)
    w = (torch.randn(V, H) * 0.3).to(DEV, dtype)
    y = torch.randint(0, V, (N,)).to(DEV)
    return h, w, y


def _grads(h, w, y, g, ge, deterministic=True):
    hh, ww = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    logp, ent = _tl().triton_token_logprobs(hh, ww, y, 0.7, True, deterministic=deterministic)
    torch.autograd.backward([logp, ent], [g.to(logp), ge.to(ent)])
    return logp.detach(), ent.detach(), hh.grad, ww.grad


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("bad", [-100, -1, V, V + 5])
def test_bad_target_on_active_row_raises(bad, deterministic, seed):
    h, w, y = _inputs()
    y[3] = bad
    g, ge = torch.randn(N), torch.randn(N)
    with pytest.raises(ValueError, match=str(bad)):
        _grads(h, w, y, g, ge, deterministic)


def test_bad_target_on_inactive_row_is_ignored(seed):
    """An ignore index on a zero-gradient row: forward reads nothing at W[y] (its log-prob is meaningless),
    backward skips the row; the other rows are as without it."""
    h, w, y = _inputs()
    g, ge = torch.randn(N), torch.randn(N)
    ref = _grads(h, w, y, g, ge)
    y2 = y.clone()
    y2[3] = -100
    g[3] = ge[3] = 0
    logp, ent, dh, dw = _grads(h, w, y2, g, ge)
    keep = torch.arange(N, device=DEV) != 3
    assert torch.equal(logp[keep], ref[0][keep]) and torch.equal(ent, ref[1])
    assert (dh[3] == 0).all() and torch.isfinite(dh).all() and torch.isfinite(dw).all()
    ref_live = _grads(h, w, y, g, ge)  # same zeroed gradients, valid target
    assert torch.equal(dh, ref_live[2]) and torch.equal(dw, ref_live[3])


def test_compute_dtype():
    f = _tl()._compute_dtype
    bf, fp16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    assert f(bf, f32) == bf and f(f32, bf) == bf and f(fp16, f32) == fp16 and f(f64, bf) == bf
    assert f(f32, f32) == f32 and f(bf, bf) == bf and f(f64, f64) == f32 and f(bf, fp16) == f32


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_mixed_dtypes_compute_in_16bit(which, half, seed):
    """fp32 + 16-bit: the fp32 operand is cast to the 16-bit dtype (as autocast), grads in input dtypes."""
    h16, w16, y = _inputs(half)
    g, ge = torch.randn(N), torch.randn(N)
    ref = _grads(h16, w16, y, g, ge)
    h, w = (h16.float(), w16) if which == "hidden" else (h16, w16.float())
    logp, ent, dh, dw = _grads(h, w, y, g, ge)
    assert dh.dtype == h.dtype and dw.dtype == w.dtype
    assert torch.equal(logp, ref[0]) and torch.equal(ent, ref[1])
    assert torch.equal(dh.to(half), ref[2]) and torch.equal(dw.to(half), ref[3])

"""The chunked driver's input handling: target validation and mixed input dtypes, both impls.

On a CPU the Triton passes run under TRITON_INTERPRET=1 (conftest.py), so the shapes stay tiny.
"""

from __future__ import annotations

import pytest
import torch
from kernel_accuracy import TRITON, impl_params

from flashdapo.kernels import CHUNKED_IMPLS
from flashdapo.kernels.chunked import chunked_token_logprobs, operand_dtype

IMPLS = impl_params(CHUNKED_IMPLS)
N, H, V = 19, 24, 37


def _device(impl):
    return torch.device("cuda" if impl == "triton" and torch.cuda.is_available() else "cpu")


def _inputs(impl, dtype=torch.float32):
    dev = _device(impl)
    h = torch.randn(N, H).to(dev, dtype)
    w = (torch.randn(V, H) * 0.3).to(dev, dtype)
    y = torch.randint(0, V, (N,)).to(dev)
    return h, w, y


def _grads(impl, h, w, y, g, ge):
    hh, ww = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    logp, ent = chunked_token_logprobs(hh, ww, y, 0.7, True, impl=impl)
    torch.autograd.backward([logp, ent], [g.to(logp), ge.to(ent)])
    return logp.detach(), ent.detach(), hh.grad, ww.grad


@pytest.mark.parametrize("bad", [-100, -1, V, V + 5])
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_target_on_active_row_raises(impl, bad, seed):
    h, w, y = _inputs(impl)
    y[3] = bad
    with pytest.raises(ValueError, match=str(bad)):
        _grads(impl, h, w, y, torch.randn(N), torch.randn(N))


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_target_on_inactive_row_is_ignored(impl, seed):
    """An ignore index on a zero-gradient row: its log-prob is meaningless, nothing is read out of bounds,
    backward skips the row; the other rows are as without it."""
    h, w, y = _inputs(impl)
    g, ge = torch.randn(N), torch.randn(N)
    ref = _grads(impl, h, w, y, g, ge)
    y2 = y.clone()
    y2[3] = -100
    g[3] = ge[3] = 0
    logp, ent, dh, dw = _grads(impl, h, w, y2, g, ge)
    keep = torch.arange(N, device=h.device) != 3
    assert torch.equal(logp[keep], ref[0][keep]) and torch.equal(ent, ref[1])
    assert (dh[3] == 0).all() and torch.isfinite(dh).all() and torch.isfinite(dw).all()
    ref_live = _grads(impl, h, w, y, g, ge)  # same zeroed gradients, valid target
    assert torch.equal(dh, ref_live[2]) and torch.equal(dw, ref_live[3])


def test_operand_dtype():
    bf, fp16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    f = lambda a, b: operand_dtype("triton", a, b)
    assert f(bf, f32) == bf and f(f32, bf) == bf and f(fp16, f32) == fp16 and f(f64, bf) == bf
    assert f(f32, f32) == f32 and f(bf, bf) == bf and f(f64, f64) == f32 and f(bf, fp16) == f32
    t = lambda a, b: operand_dtype("torch", a, b)
    assert t(bf, bf) == f32 and t(f64, f64) == f64 and t(f64, f32) == f32


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["hidden", "weight"])
@pytest.mark.parametrize("impl", [TRITON])
def test_mixed_dtypes_compute_in_16bit(impl, which, half, seed):
    """triton, fp32 + 16-bit: the fp32 operand is cast to the 16-bit dtype (as autocast), gradients in the
    input dtypes."""
    h16, w16, y = _inputs(impl, half)
    g, ge = torch.randn(N), torch.randn(N)
    ref = _grads(impl, h16, w16, y, g, ge)
    h, w = (h16.float(), w16) if which == "hidden" else (h16, w16.float())
    logp, ent, dh, dw = _grads(impl, h, w, y, g, ge)
    assert dh.dtype == h.dtype and dw.dtype == w.dtype
    assert torch.equal(logp, ref[0]) and torch.equal(ent, ref[1])
    assert torch.equal(dh.to(half), ref[2]) and torch.equal(dw.to(half), ref[3])

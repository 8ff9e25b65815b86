"""Compiled Triton kernels at real LM-head shapes (GPU only; run by bench/gpu_check.py via `-m cuda`).

Sized for one H200 in well under a minute each: the float64 naive reference of the 0.5B shape holds
~50 GB of logits and their gradients at its peak.
"""

from __future__ import annotations

import time

import pytest
import torch
from kernel_accuracy import check

from flashdapo.kernels.chunked import chunked_token_logprobs
from flashdapo.kernels.naive import naive_token_logprobs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

QWEN_05B = (8192, 896, 151936)
QWEN_7B_SMALL_N = (2048, 3584, 152064)


def _inputs(n, hdim, vocab, dtype=torch.bfloat16):
    dev = torch.device("cuda")
    h = torch.randn(n, hdim, device=dev).to(dtype)
    w = (torch.randn(vocab, hdim, device=dev) / hdim**0.5 * 4).to(dtype)  # logits of std ~4
    y = torch.randint(0, vocab, (n,), device=dev)
    return h, w, y


def _upstream(n):
    dev = torch.device("cuda")
    return torch.randn(n, device=dev, dtype=torch.float64), torch.randn(n, device=dev, dtype=torch.float64)


@pytest.mark.parametrize("shape", [QWEN_05B, QWEN_7B_SMALL_N], ids=["qwen2.5-0.5b", "qwen2.5-7b-n2048"])
def test_qwen_shapes_match_float64(shape, seed):
    h, w, y = _inputs(*shape)
    g, ge = _upstream(shape[0])
    logp, ent, _, _ = check("triton", h, w, y, 1.0, g, ge, on_cpu=False, blocked=False)
    assert (logp <= 0).all() and (ent >= 0).all()
    torch.cuda.empty_cache()


GEMMA3_4B = (4096, 2560, 262208)
"""Gemma 3 4B's LM head (hidden 2560, vocabulary 262,208), whose logits are softcapped at 30 in Gemma 2/3/4."""


@pytest.mark.parametrize("cap", [30.0, 3.0], ids=["gemma-cap30", "saturating-cap3"])
def test_softcapped_gemma_shape_matches_float64(cap, seed):
    """The compiled kernels with the final-logit softcap against float64, log-prob, entropy and both gradients."""
    h, w, y = _inputs(*GEMMA3_4B)
    g, ge = _upstream(GEMMA3_4B[0])
    logp, ent, _, _ = check("triton", h, w, y, 1.0, g, ge, on_cpu=False, blocked=False, softcap=cap)
    assert (logp <= 0).all() and (ent >= 0).all()
    torch.cuda.empty_cache()


def triton_token_logprobs(*args, **kw):
    return chunked_token_logprobs(*args, impl="triton", **kw)


def test_offsets_past_int32_tokens_times_vocab(seed):
    """N x V = 2.49e9 > 2^31 (what a kernel materializing or indexing [N, V] would overflow)."""
    n, hdim, vocab = 16384, 64, 151936
    h, w, y = _inputs(n, hdim, vocab)
    g, _ = _upstream(n)
    outs = []
    reference = lambda *a: chunked_token_logprobs(*a, tile_elems=1 << 26)  # float64 below: O(N) memory
    for fn in (triton_token_logprobs, reference):
        hh = (h if fn is triton_token_logprobs else h.double()).clone().requires_grad_(True)
        ww = (w if fn is triton_token_logprobs else w.double()).clone().requires_grad_(True)
        logp, _ = fn(hh, ww, y, 1.0, False)
        logp.backward(g.to(logp.dtype))
        outs.append([logp.detach().double(), hh.grad.double(), ww.grad.double()])
    (logp, dh, dw), (ref_logp, ref_dh, ref_dw) = outs
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-4)  # every row, the last ones included
    for got, ref in ((dh, ref_dh), (dw, ref_dw)):  # bf16 gradients: a few bf16 ulps
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=1e-2 * ref.abs().max().item())


def test_offsets_past_int32_tokens_times_hidden(seed):
    """N x H > 2^31 elements of hidden (and of dh): the last rows must be right."""
    hdim, vocab = 64, 128
    n = 2**31 // hdim + 4096
    h, w, y = _inputs(n, hdim, vocab)
    g = torch.randn(n, device=h.device)
    hh = h.clone().requires_grad_(True)
    logp, _ = triton_token_logprobs(hh, w, y, 1.0, False)  # frozen W: dh only
    logp.backward(g)
    tail = slice(n - 2048, n)
    h64 = h[tail].double().requires_grad_(True)
    ref, _ = naive_token_logprobs(h64, w.double(), y[tail], 1.0, False)
    ref.backward(g[tail].double())
    torch.testing.assert_close(logp[tail].double(), ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(hh.grad[tail].double(), h64.grad, rtol=2e-2, atol=2e-2 * h64.grad.abs().max().item())


def _grads(h, w, y, g, ge):
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, ent = triton_token_logprobs(hh, ww, y, 1.0, True)
    torch.autograd.backward([logp, ent], [g.float(), ge.float()])
    return logp, ent, hh.grad, ww.grad


def test_deterministic_bitwise(seed):
    n, hdim, vocab = 2048, 896, 151936
    h, w, y = _inputs(n, hdim, vocab)
    g, ge = _upstream(n)
    first, second = _grads(h, w, y, g, ge), _grads(h, w, y, g, ge)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "backward must be bitwise reproducible"


def test_skipped_rows_save_backward_time(seed):
    """With 90% of the rows at zero gradient (masked/clipped), backward takes well under half the time."""
    n, hdim, vocab = 8192, 896, 151936
    h, w, y = _inputs(n, hdim, vocab)
    g, _ = _upstream(n)
    sparse = g.clone()
    sparse[torch.rand(n, device=h.device) < 0.9] = 0

    def backward_ms(upstream):
        times = []
        for _ in range(3):
            hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
            logp, _ = triton_token_logprobs(hh, ww, y, 1.0, False)
            torch.cuda.synchronize()
            start = time.perf_counter()
            logp.backward(upstream.float())
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[1] * 1e3

    dense_ms, sparse_ms = backward_ms(g), backward_ms(sparse)
    print(f"backward: all rows {dense_ms:.1f} ms, 10% rows {sparse_ms:.1f} ms")
    assert sparse_ms < 0.5 * dense_ms

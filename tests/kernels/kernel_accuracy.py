"""Accuracy helpers shared by the kernel tests: run an impl, the float64 reference, and the criterion.

Criterion (Apple CCE's, made robust): the max error vs float64 is no larger than naive torch's in the
same dtype plus 2 eps of the output dtype at the problem's scale (max |logit| for log-prob/entropy,
max |gradient| for gradients). Naive's error is itself one draw from its rounding: with the hidden or the
vocabulary dimension permuted (the same math, another summation order) it varies by up to ~8x on small
shapes, and BLAS rounds few-row matmuls differently, so "naive's error" is the worst of six equally
valid runs: as is, in 8-row blocks, with H permuted twice and with V permuted twice.

Gradients get one more allowance, for fp32 summation in another order: dh = dz W sums V terms and
dW = dz^T h sums N, and any order rounds within ~sqrt(K) eps32 sum|terms| (the probabilistic bound of a
K-term sum). Without it the criterion rejected valid computations: naive itself with V permuted once
more failed it on 4 of 150 random inputs of test_matches_float64 (5 of 300 with the V permutations in
the envelope; worst 0.44 of this allowance). It is negligible next to 2 eps of a 16-bit output.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flashdapo.kernels import token_logprobs
from flashdapo.kernels.chunked import chunked_token_logprobs
from flashdapo.kernels.fused import fused_token_loss
from flashdapo.kernels.naive import naive_token_logprobs

ON_CUDA = torch.cuda.is_available()
# The triton case: skipped without triton; with a GPU it runs the compiled kernels, so it carries the
# `cuda` mark (`pytest -m cuda` selects it); on a CPU it runs under the interpreter, unmarked.
TRITON_MARKS = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
                *([pytest.mark.cuda] if ON_CUDA else [])]
TRITON = pytest.param("triton", marks=TRITON_MARKS)


def impl_params(impls) -> list:
    """`impls` as pytest parameters, the triton one carrying TRITON_MARKS."""
    return [TRITON if impl == "triton" else impl for impl in impls]


EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
SLACK = 2.0  # units of roundoff allowed beyond naive's own error (summation order differs)


def logprobs(impl, h, w, y, temperature=1.0):
    if impl == "tiled":
        return chunked_token_logprobs(h, w, y, temperature, True, chunk_tokens=8, chunk_vocab=128)
    if impl == "naive_dtype":
        return naive_token_logprobs(h, w, y, temperature, True)
    if impl == "naive_blocked":  # BLAS picks other kernels (other rounding) for few-row matmuls
        parts = [naive_token_logprobs(h[i : i + 8], w, y[i : i + 8], temperature, True) for i in range(0, len(y), 8)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return token_logprobs(h, w, y, temperature=temperature, with_entropy=True, impl=impl)


def run(impl, h, w, y, temperature, g, ge, on_cpu=True):
    """(logp, entropy, dh, dW) as float64 tensors (moved to the CPU unless on_cpu=False); g / ge are
    upstream gradients of logp / entropy (or None).

    impl "fused-<impl>" runs fused_token_loss(impl=<impl>) on the loss sum(g logp) (its gradient formed
    in the forward; no entropy gradient, so ge must be None); "fused-<impl>-tiled" forces 8-row token
    chunks and 128-column vocabulary tiles, so that the merge across tiles runs at small shapes."""
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    if impl.startswith("fused-"):
        assert ge is None, "the fused sweep has no entropy gradient"
        kernel, tiled = impl.split("-")[1], impl.endswith("-tiled")
        g_out = g.to(h.device, torch.float64 if h.dtype == torch.float64 else torch.float32)
        loss_fn = lambda lp, rows: (lp * g_out[rows]).sum()  # noqa: E731 - dL/dlogp = g
        loss, logp, ent = fused_token_loss(h, w, y, loss_fn, temperature=temperature, impl=kernel,
                                           chunk_tokens=8 if tiled else None, chunk_vocab=128 if tiled else None)
        loss.backward()
    else:
        logp, ent = logprobs(impl, h, w, y, temperature)
        outs, grads = [], []
        for out, grad in ((logp, g), (ent, ge)):
            if grad is not None:
                outs.append(out)
                grads.append(grad.to(out.device, out.dtype))
        torch.autograd.backward(outs, grads)
    results = [t.detach().double() for t in (logp, ent, h.grad, w.grad)]
    return [t.cpu() for t in results] if on_cpu else results


def reference(h, w, y, temperature, g, ge, on_cpu=True):
    """Naive torch on float64 copies of the same inputs, on the inputs' device."""
    as64 = lambda t: None if t is None else t.double()
    return run("naive_dtype", h.double(), w.double(), y, temperature, as64(g), as64(ge), on_cpu)


def naive_envelope(h, w, y, temperature, g, ge, on_cpu=True, blocked=True, orders=2):
    """Naive torch in the inputs' dtype: as is, in 8-row blocks (if `blocked`), with H jointly permuted
    `orders` times and with V permuted `orders` times: the same math, other rounding."""
    names = ("naive_dtype", "naive_blocked") if blocked else ("naive_dtype",)
    runs = [run(name, h, w, y, temperature, g, ge, on_cpu) for name in names]
    gen = torch.Generator().manual_seed(0)
    for _ in range(orders):
        perm = torch.randperm(h.shape[1], generator=gen).to(h.device)
        inv = torch.argsort(perm)
        logp, ent, dh, dw = run("naive_dtype", h[:, perm].contiguous(), w[:, perm].contiguous(), y,
                                temperature, g, ge, on_cpu)
        runs.append([logp, ent, dh[:, inv.to(dh.device)], dw[:, inv.to(dw.device)]])
    for _ in range(orders):
        perm = torch.randperm(w.shape[0], generator=gen).to(w.device)
        inv = torch.argsort(perm)
        logp, ent, dh, dw = run("naive_dtype", h, w[perm].contiguous(), inv[y], temperature, g, ge, on_cpu)
        runs.append([logp, ent, dh, dw[inv.to(dw.device)]])
    return runs


def gradient_term_scales(h, w, y, temperature, g, ge) -> tuple[float, float]:
    """max_j sum_v |dz_iv W_vj| and max sum_i |dz_iv h_ij|, in float64: the sizes of the summed terms,
    which bound the rounding of dh = dz W and dW = dz^T h in any summation order (cancellation included)."""
    h, w = h.double(), w.double()
    z = (h @ w.T) / temperature
    logp = torch.log_softmax(z, dim=1)
    p = logp.exp()
    dz = torch.zeros_like(z)
    if g is not None:
        dz -= g.to(z).unsqueeze(1) * p
        dz[torch.arange(len(y)), y.long()] += g.to(z)
    if ge is not None:
        ent = -(p * logp).sum(1, keepdim=True)
        dz += ge.to(z).unsqueeze(1) * p * (-ent - logp)
    dz = dz.abs() / temperature
    return (dz @ w.abs()).max().item(), (dz.T @ h.abs()).max().item()


def check(impl, h, w, y, temperature, g, ge, on_cpu=True, blocked=True):
    """Assert impl's accuracy against float64 by the criterion above; return impl's outputs (float64)."""
    got = run(impl, h, w, y, temperature, g, ge, on_cpu)
    naive = naive_envelope(h, w, y, temperature, g, ge, on_cpu, blocked)
    ref = reference(h, w, y, temperature, g, ge, on_cpu)
    z_scale = max(1.0, ((h.double() @ w.double().T) / temperature).abs().max().item())
    term_scales = gradient_term_scales(h, w, y, temperature, g, ge)
    sum_lengths = (w.shape[0], h.shape[0])  # dh sums over V, dW over N
    names = ("logp", "entropy", "dh", "dW")
    for i, (name, a, r) in enumerate(zip(names, got, ref)):
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        eps = EPS[torch.float32] if i < 2 else EPS[h.dtype if name == "dh" else w.dtype]
        scale = z_scale if i < 2 else max(r.abs().max().item(), 1e-30)
        err = (a - r).abs().max().item()
        base = max((other[i] - r).abs().max().item() for other in naive)
        tol = SLACK * eps * scale
        if i >= 2:
            tol += sum_lengths[i - 2] ** 0.5 * EPS[torch.float32] * term_scales[i - 2]
        assert err <= base + tol, f"{impl} {name}: error {err:.3e} > naive's {base:.3e} + {tol:.3e}"
    return got

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
import math

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


def logprobs(impl, h, w, y, temperature=1.0, softcap=None):
    if callable(impl):  # a test's own call: impl(h, w, y, temperature, softcap) -> (logp, entropy)
        return impl(h, w, y, temperature, softcap)
    if impl == "tiled":
        return chunked_token_logprobs(h, w, y, temperature, True, chunk_tokens=8, chunk_vocab=128, softcap=softcap)
    if impl == "naive_dtype":
        return naive_token_logprobs(h, w, y, temperature, True, softcap)
    if impl.startswith("naive_vblocked"):  # the logits GEMM in vocabulary blocks, as the kernels' tiles
        return _naive_vblocked(h, w, y, temperature, softcap, int(impl.removeprefix("naive_vblocked")))
    if impl == "naive_blocked":  # BLAS picks other kernels (other rounding) for few-row matmuls
        parts = [naive_token_logprobs(h[i : i + 8], w, y[i : i + 8], temperature, True, softcap)
                 for i in range(0, len(y), 8)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return token_logprobs(h, w, y, temperature=temperature, with_entropy=True, impl=impl, softcap=softcap)


def _naive_vblocked(h, w, y, temperature, softcap, block):
    """Naive torch (materialized logits, autograd) with h W^T computed in vocabulary blocks of `block`."""
    dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    hh, ww = h.to(dtype), w.to(dtype)
    x = torch.cat([hh @ ww[v0 : v0 + block].T for v0 in range(0, w.shape[0], block)], dim=1)
    logits = (x if softcap is None else softcap * torch.tanh(x / softcap)) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    return logp_all.gather(-1, y.long().unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def capped_logits(h, w, temperature, softcap=None):
    """The logits every impl works on, in float64: (c tanh(h W^T / c) or h W^T) / T."""
    x = h.double() @ w.double().T
    return (x if softcap is None else softcap * torch.tanh(x / softcap)) / temperature


def run(impl, h, w, y, temperature, g, ge, on_cpu=True, softcap=None):
    """(logp, entropy, dh, dW) as float64 tensors (moved to the CPU unless on_cpu=False); g / ge are
    upstream gradients of logp / entropy (or None); `softcap`: the final-logit cap (None: off).

    impl "fused-<impl>" runs fused_token_loss(impl=<impl>) on the loss sum(g logp) (its gradient formed
    in the forward; no entropy gradient, so ge must be None); "fused-<impl>-tiled" forces 8-row token
    chunks and 128-column vocabulary tiles, so that the merge across tiles runs at small shapes."""
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    if isinstance(impl, str) and impl.startswith("fused-"):
        assert ge is None, "the fused sweep has no entropy gradient"
        kernel, tiled = impl.split("-")[1], impl.endswith("-tiled")
        g_out = g.to(h.device, torch.float64 if h.dtype == torch.float64 else torch.float32)
        loss_fn = lambda lp, rows: (lp * g_out[rows]).sum()  # noqa: E731 - dL/dlogp = g
        loss, logp, ent = fused_token_loss(h, w, y, loss_fn, temperature=temperature, impl=kernel,
                                           chunk_tokens=8 if tiled else None, chunk_vocab=128 if tiled else None,
                                           softcap=softcap)
        loss.backward()
    else:
        logp, ent = logprobs(impl, h, w, y, temperature, softcap)
        outs, grads = [], []
        for out, grad in ((logp, g), (ent, ge)):
            if grad is not None:
                outs.append(out)
                grads.append(grad.to(out.device, out.dtype))
        torch.autograd.backward(outs, grads)
    results = [t.detach().double() for t in (logp, ent, h.grad, w.grad)]
    return [t.cpu() for t in results] if on_cpu else results


def reference(h, w, y, temperature, g, ge, on_cpu=True, softcap=None):
    """Naive torch on float64 copies of the same inputs, on the inputs' device."""
    as64 = lambda t: None if t is None else t.double()
    return run("naive_dtype", h.double(), w.double(), y, temperature, as64(g), as64(ge), on_cpu, softcap)


def naive_envelope(h, w, y, temperature, g, ge, on_cpu=True, blocked=True, orders=2, softcap=None):
    """Naive torch in the inputs' dtype: as is, in 8-row blocks (if `blocked`), with H jointly permuted
    `orders` times and with V permuted `orders` times: the same math, other rounding."""
    names = ("naive_dtype", "naive_blocked") if blocked else ("naive_dtype",)
    if softcap is not None:  # the kernels' vocabulary tiles (interpreter: 32 columns; "tiled": 128) round x
        names += ("naive_vblocked32", "naive_vblocked128")  # otherwise, and sech^2's slope 2|t|/c carries it
    runs = [run(name, h, w, y, temperature, g, ge, on_cpu, softcap) for name in names]
    gen = torch.Generator().manual_seed(0)
    for _ in range(orders):
        perm = torch.randperm(h.shape[1], generator=gen).to(h.device)
        inv = torch.argsort(perm)
        logp, ent, dh, dw = run("naive_dtype", h[:, perm].contiguous(), w[:, perm].contiguous(), y,
                                temperature, g, ge, on_cpu, softcap)
        runs.append([logp, ent, dh[:, inv.to(dh.device)], dw[:, inv.to(dw.device)]])
    for _ in range(orders):
        perm = torch.randperm(w.shape[0], generator=gen).to(w.device)
        inv = torch.argsort(perm)
        logp, ent, dh, dw = run("naive_dtype", h, w[perm].contiguous(), inv[y], temperature, g, ge, on_cpu, softcap)
        runs.append([logp, ent, dh, dw[inv.to(dw.device)]])
    return runs


def logit_gradient(z, y, g, ge) -> torch.Tensor:
    """d(sum_i g_i logp_i(y_i) + ge_i H_i)/dz of logits z [N, V] (float64): the upstream gradient of the
    log-prob g and of the entropy ge (either None)."""
    logp = torch.log_softmax(z, dim=1)
    p = logp.exp()
    dz = torch.zeros_like(z)
    if g is not None:
        dz -= g.to(z).unsqueeze(1) * p
        dz[torch.arange(len(y)), y.long()] += g.to(z)
    if ge is not None:
        ent = -(p * logp).sum(1, keepdim=True)
        dz += ge.to(z).unsqueeze(1) * p * (-ent - logp)
    return dz


def gradient_term_scales(h, w, y, temperature, g, ge, softcap=None) -> tuple[float, float]:
    """max_j sum_v |dz_iv W_vj| and max sum_i |dz_iv h_ij|, in float64: the sizes of the summed terms,
    which bound the rounding of dh = dz W and dW = dz^T h in any summation order (cancellation included).
    With a softcap, dz is w.r.t. the raw logits (times sech^2(h W^T / c))."""
    h, w = h.double(), w.double()
    dz = logit_gradient(capped_logits(h, w, temperature, softcap), y, g, ge).abs() / temperature
    if softcap is not None:
        dz = dz / torch.cosh((h @ w.T) / softcap) ** 2
    return (dz @ w.abs()).max().item(), (dz.T @ h.abs()).max().item()


def cap_rounding_terms(h, w, y, temperature, g, ge, softcap=None) -> tuple[float, float, float]:
    """With a cap: what a raw logit's rounding moves, per unit of eps32, in (log-prob, dh, dW); (0, 0, 0) off.

    Every kernel computes x = h W^T in its own tiles, and a GEMM rounds x within ~eps sum_i |h_i w_vi|
    (R, cancellation included), differently per tile shape. Without a cap that rounding reaches z = x / T
    at the logits' own scale (max |z|, in the criterion's 2 eps). A cap shrinks the logits' scale to c / T
    but passes the rounding of x on at slope sech^2(x / c) / T <= 1 / T: logits of magnitude 50 under a cap
    of 0.5 still carry it, so the log-prob term is max R sech^2 / T. The gradient w.r.t. x is the capped
    one times sech^2(x / c), whose relative slope is 2 |tanh(x / c)| / c (4 at c = 0.5): so each term
    dz_v W_vj moves by |dz_v W_vj| (2 |t_v| / c) R_v, summed as in gradient_term_scales."""
    if softcap is None:
        return 0.0, 0.0, 0.0
    h, w = h.double(), w.double()
    x = h @ w.T
    t, d = torch.tanh(x / softcap), torch.cosh(x / softcap) ** -2
    r = h.abs() @ w.abs().T
    dz = logit_gradient(softcap * t / temperature, y, g, ge)
    sens = dz.abs() / temperature * d * (2 * t.abs() / softcap) * r
    return (r * d).max().item() / temperature, (sens @ w.abs()).max().item(), (sens.T @ h.abs()).max().item()


def check(impl, h, w, y, temperature, g, ge, on_cpu=True, blocked=True, softcap=None, report=None):
    """Assert impl's accuracy against float64 by the criterion above; return impl's outputs (float64).
    `softcap`: the final-logit cap c (None: off); the problem's logit scale is then max(|c tanh(x / c) / T|,
    log V), plus the raw logits' rounding as the cap passes it on (cap_rounding_terms).
    `report` (a list): gets one dict per output (name, err, naive's error, tolerance, scale)."""
    got = run(impl, h, w, y, temperature, g, ge, on_cpu, softcap)
    naive = naive_envelope(h, w, y, temperature, g, ge, on_cpu, blocked, softcap=softcap)
    ref = reference(h, w, y, temperature, g, ge, on_cpu, softcap)
    z_scale = max(1.0, capped_logits(h, w, temperature, softcap).abs().max().item())
    if softcap is not None:  # log p and entropy reach log V, which a small cap's logits (|z| < c / T) do not
        z_scale = max(z_scale, math.log(w.shape[0]))
    term_scales = gradient_term_scales(h, w, y, temperature, g, ge, softcap)
    cap_terms = cap_rounding_terms(h, w, y, temperature, g, ge, softcap)
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
        tol += EPS[torch.float32] * cap_terms[max(0, i - 1)]  # 0 without a cap
        if report is not None:
            report.append({"name": name, "err": err, "naive": base, "tol": tol, "scale": scale})
        assert err <= base + tol, f"{impl} {name}: error {err:.3e} > naive's {base:.3e} + {tol:.3e}"
    return got

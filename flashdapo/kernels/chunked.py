"""Chunked torch path: per-token log-prob / entropy through the LM head without `[N, V]` logits.

The forward walks token chunks (and vocabulary chunks when one chunk row-block times V would be large),
keeping per token an online (max m, sum s = sum exp(z - m), sum u = sum exp(z - m) (z - m)) triple,
exactly as the Triton kernel does; it saves only m, log s and the entropy, O(N) floats. The backward
recomputes each logit tile from h and W and forms

    dz = g (onehot(y) - p) + gH p (E_p[z] - z),    dh = dz W / T,   dW = dz^T h / T,

accumulated in fp32 (fp64 for fp64 inputs, so that gradcheck applies). Rows whose g and gH are both
zero (masked, prompt and clipped tokens under the DAPO loss) are dropped before any matmul.

Numerics: log p = (z - m) - log s in backward, not z - lse: lse = m + log s rounds to eps |m|, which at
T = 0.05 (|z| ~ 1e3) would put a 1e-4 relative error on p. u is kept relative to the running max, so
entropy = log s - u / s needs no cancellation of large terms and is >= 0 by construction (u <= 0);
logp = (z_y - m) - log s <= 0 by construction (z_y is one of the values that made m, and s >= 1). 16-bit inputs are upcast chunk-wise to fp32, so
this path has naive torch's accuracy. It runs on any device and is the CPU default.
"""

from __future__ import annotations

import torch

# Elements of one fp32 logit tile (4 MiB: 512 tokens x 2048 vocabulary), and the token rows a chunk aims
# for. The tile and one temporary of its size are the working set of the elementwise passes, which run at
# cache speed only while they stay in a CPU's L2/L3; the rows per chunk are the K of the dW matmul, and
# every chunk reads and writes its [bv, H] slab of dW once, so taller chunks move less memory. Measured
# on a 2-core EPYC at N=8192, H=256, V=32768 (bench/results/NOTES.md): 0.5-1 Mi elements 2.85 s,
# 4 Mi 3.1 s, 16 Mi 3.7 s; 512 vs 1024 rows within noise. Callers may pass `tile_elems` etc.
DEFAULT_TILE_ELEMS = 1 << 20
TARGET_CHUNK_TOKENS = 512


def _plan(num_tokens: int, vocab: int, tile_elems: int) -> tuple[int, int]:
    """(token chunk, vocab chunk) with chunk x vocab-chunk <= tile_elems where possible."""
    bn = max(1, min(num_tokens, TARGET_CHUNK_TOKENS))
    bv = max(1, min(vocab, tile_elems // bn))
    if bv == vocab:  # the whole vocabulary fits: take as many rows as the tile holds
        bn = max(1, min(num_tokens, tile_elems // vocab))
    return bn, bv


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if all(t.dtype == torch.float64 for t in tensors) else torch.float32


def _logits(hs, w_chunk, temperature):
    """One logit tile z = h W^T / T: the 2 n bv H FLOPs. Divided after the matmul, as naive torch does."""
    z = hs @ w_chunk.T
    return z.div_(temperature) if temperature != 1.0 else z


def _chunk_stats(hs, w_chunk, y_local, temperature, with_entropy):
    """Tile statistics of one (token chunk, vocab chunk): max, sum exp, sum exp*(z - max), target logit.

    hs [n, H] is h in the compute dtype; y_local [n] the targets minus the chunk start (out of range
    when the target lies in another chunk: those rows get -inf and are filled by another chunk).
    """
    z = _logits(hs, w_chunk, temperature)
    inside = (y_local >= 0) & (y_local < z.shape[1])
    z_y = z.gather(1, y_local.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    z_y = torch.where(inside, z_y, torch.full_like(z_y, float("-inf")))
    m = z.amax(dim=1)
    z.sub_(m.unsqueeze(1))  # in place: z - m <= 0 from here on
    if with_entropy:
        e = torch.exp(z)
        u = torch.linalg.vecdot(e, z, dim=1)
        s = e.sum(dim=1)
    else:
        s = z.exp_().sum(dim=1)
        u = None
    return m, s, u, z_y


def _merge(m, s, u, m2, s2, u2):
    """Merge two online (max, sum exp, sum exp*(z - max)) triples; m, m2 finite."""
    m_new = torch.maximum(m, m2)
    a, b = torch.exp(m - m_new), torch.exp(m2 - m_new)
    if u is not None:
        u = a * (u + (m - m_new) * s) + b * (u2 + (m2 - m_new) * s2)
    return m_new, a * s + b * s2, u


def _forward(hidden, weight, targets, temperature, with_entropy, bn, bv):
    """Per-token (logp, m, log s, entropy or None) in the compute dtype, chunk by chunk."""
    cdtype = _compute_dtype(hidden, weight)
    n_tok, vocab = hidden.shape[0], weight.shape[0]
    w = weight.to(cdtype)  # no copy for fp32/fp64 weights; one fp32 copy of W for 16-bit weights
    logp = hidden.new_empty(n_tok, dtype=cdtype)
    m_all, log_s_all = torch.empty_like(logp), torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    for r0 in range(0, n_tok, bn):
        r1 = min(r0 + bn, n_tok)
        hs = hidden[r0:r1].to(cdtype)
        y = targets[r0:r1].long()
        m = s = u = z_y = None
        for v0 in range(0, vocab, bv):
            m2, s2, u2, zy2 = _chunk_stats(hs, w[v0 : v0 + bv], y - v0, temperature, with_entropy)
            if m is None:
                m, s, u, z_y = m2, s2, u2, zy2
            else:
                m, s, u = _merge(m, s, u, m2, s2, u2)
                z_y = torch.maximum(z_y, zy2)
        log_s = torch.log(s)
        logp[r0:r1] = (z_y - m) - log_s
        m_all[r0:r1], log_s_all[r0:r1] = m, log_s
        if with_entropy:
            entropy[r0:r1] = log_s - u / s
    return logp, m_all, log_s_all, entropy


def _tile_grad(z, m, log_s, ent, g, g_ent, y_local):
    """dz of one recomputed tile, in place over z: g (onehot - p) + gH p (E_p z - z).

    With t = (z - m) - log s = log p and E_p z = lse - entropy: E_p z - z = -entropy - t.
    """
    if g_ent is None:  # p = exp(z - m) / s: three passes over the tile instead of four
        dz = z.sub_(m.unsqueeze(1)).exp_().mul_((-g * torch.exp(-log_s)).unsqueeze(1))
    else:
        t = z.sub_(m.unsqueeze(1)).sub_(log_s.unsqueeze(1))
        p = torch.exp(t)
        coef = t.neg_().sub_(ent.unsqueeze(1)).mul_(g_ent.unsqueeze(1)).sub_(g.unsqueeze(1))
        dz = p.mul_(coef)
    rows = torch.nonzero((y_local >= 0) & (y_local < z.shape[1])).squeeze(1)
    if rows.numel():
        dz[rows, y_local[rows]] += g[rows]
    return dz


def _backward(ctx, grad_logp, grad_ent):
    """dh, dW over the rows with a nonzero upstream gradient; fp32/fp64 accumulation."""
    hidden, weight, targets, m_all, log_s_all, entropy = ctx.saved_tensors
    temperature, bn, bv = ctx.temperature, ctx.bn, ctx.bv
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    cdtype = m_all.dtype
    active = torch.zeros_like(m_all, dtype=torch.bool)
    if grad_logp is not None:
        active |= grad_logp != 0
    if grad_ent is not None:
        active |= grad_ent != 0
    rows = torch.nonzero(active).squeeze(1)  # one host sync: sizes the work to the rows that need it
    n_act, vocab = rows.numel(), weight.shape[0]
    dh = torch.zeros_like(hidden) if need_h else None
    dw = torch.zeros(weight.shape, dtype=cdtype, device=weight.device) if need_w else None
    if n_act == 0 or not (need_h or need_w):
        return dh, (dw.to(weight.dtype) if need_w else None)
    dense = n_act == hidden.shape[0]  # every row active: slices (views) instead of gathers
    w = weight.to(cdtype)
    # 1/T of dz = (dL/dz) / T folded into the per-row upstream gradients (N multiplies, not N V).
    g_all = (grad_logp if grad_logp is not None else torch.zeros_like(m_all)).to(cdtype) / temperature
    ge_all = grad_ent.to(cdtype) / temperature if grad_ent is not None else None
    for r0 in range(0, n_act, bn):
        sel = slice(r0, min(r0 + bn, n_act)) if dense else rows[r0 : r0 + bn]
        hs = hidden[sel].to(cdtype)
        y, g, m, log_s = targets[sel].long(), g_all[sel], m_all[sel], log_s_all[sel]
        ge, ent = (ge_all[sel], entropy[sel]) if ge_all is not None else (None, None)
        dh_chunk = torch.zeros_like(hs) if need_h else None
        for v0 in range(0, vocab, bv):
            w_chunk = w[v0 : v0 + bv]
            dz = _tile_grad(_logits(hs, w_chunk, temperature), m, log_s, ent, g, ge, y - v0)
            if need_h:
                dh_chunk.addmm_(dz, w_chunk)
            if need_w:
                dw[v0 : v0 + bv].addmm_(dz.T, hs)
        if need_h:
            dh[sel] = dh_chunk.to(hidden.dtype)
    return dh, (dw.to(weight.dtype) if need_w else None)


class _ChunkedLogprobs(torch.autograd.Function):
    """(logp, entropy) with saved per-token statistics only; logits recomputed in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, bn, bv):
        # An output whose gradient is not needed (the entropy, in the DAPO loss) reaches backward as None,
        # not as zeros: its term is then skipped instead of computed on zeros.
        ctx.set_materialize_grads(False)
        logp, m, log_s, entropy = _forward(hidden, weight, targets, temperature, with_entropy, bn, bv)
        ctx.temperature, ctx.bn, ctx.bv = temperature, bn, bv
        ctx.save_for_backward(hidden, weight, targets, m, log_s, entropy if with_entropy else log_s)
        return logp, entropy  # compute dtype: fp32, or fp64 for fp64 inputs

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        dh, dw = _backward(ctx, grad_logp, grad_ent)
        return dh, dw, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    tile_elems: int | None = None,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) [N] fp32 and optionally entropy [N] fp32, chunked (see module doc).

    hidden [N, H], weight [V, H], targets [N] in [0, V). Differentiable in hidden and weight through
    logp and entropy (upstream gradients of any sign; None for either is fine). fp64 inputs compute
    and return fp64 (for gradcheck). `tile_elems` bounds the logit tile (default DEFAULT_TILE_ELEMS,
    read at call time); `chunk_tokens`/`chunk_vocab`
    force a chunking (tests use them to cover the multi-chunk paths on tiny shapes).
    """
    n_tok, vocab = hidden.shape[0], weight.shape[0]
    bn, bv = _plan(n_tok, vocab, tile_elems or DEFAULT_TILE_ELEMS)
    bn = max(1, chunk_tokens or bn)
    bv = max(1, min(vocab, chunk_vocab or bv))
    return _ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), bool(with_entropy), bn, bv)

"""The fused sweep: log-probs and the gradient of a per-token loss in one pass over the logits.

A per-token loss (the DAPO token loss with its global normalizer) has dL/dlogp_i depending only on row
i's own log-prob, so the gradient can be formed in the sweep that computes the log-probs (Liger's
approach): per token chunk t, keep its tiles for the whole vocabulary (the logits z = h_t W^T in fp32 on
the Triton path; e = exp(z/T - m_tile) on the torch path, so that its gradient pass is one multiply),
merge their statistics into logp_t, ask the loss for g_t = dL/dlogp_t (autograd on the chunk's [C]
vector), then turn the kept tiles into dz and accumulate dh_t += dz W and dW += dz^T h_t inside the
GEMMs. That is 6 N H V FLOPs instead of the generic path's 8 (no recompute), at the cost of holding a
[C, V] fp32 tile set (C from a memory budget) and, for 16-bit W, an fp32 dW accumulator.

The gradients are computed in the forward, in their final dtypes; the backward hands them on, scaled in
place by the loss's upstream gradient. Rows outside `keep` (loss mask 0) are dropped before any matmul,
and rows of a chunk whose g is exactly zero (clipped tokens) before the backward matmuls. Fixed chunk
order, no atomics: same inputs, same bits. docs/kernels.md has the design and its cost.

A final-logit softcap c (Gemma) is applied in the tile passes: the Triton path keeps the raw z and its
gradient kernel recomputes tanh and sech^2 from it; the torch path keeps e sech^2(z / c) instead of e
(one more spare tile in the buffer) and d_y = sech^2 at each row's target, so its gradient pass stays one
multiply and the one-hot term g d_y.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .chunked import (
    INVARIANT_CHUNK_VOCAB,
    Plan,
    check_targets,
    fp16_scale,
    operand_dtype,
    plan_chunks,
    tile_logits,
    tile_ops_for,
)
from .gemm import mm_acc_
from .softcap import normalize_softcap

TokenLossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Byte budget of one token chunk's fp32 tile set [C, V]: C follows from it (a multiple of 64 rows when
# more than 128 fit). CPU: 64 MiB (512 rows at V=32768; on the 2-core EPYC, one thread, 256 rows took
# 1.07x its time, 1024 rows the same time for twice the memory), so the sweep's extra memory is the
# gradients plus ~80 MB (the tile set and one spare tile);
# CUDA: 2 GiB (3456 rows at V=152064), so that the fp32 dW accumulator's traffic per chunk stays inside
# compute-bound GEMMs (K = C). Vocabulary tiles of 4096 columns on both.
CPU_TILESET_BYTES, CUDA_TILESET_BYTES, TILE_VOCAB = 64 << 20, 2 << 30, 4096


def fused_chunk_tokens(num_tokens: int, vocab: int, device_type: str) -> int:
    """Token rows per chunk of the fused sweep: as many as the device's tile-set budget holds."""
    if device_type == "interpret":
        return max(1, min(num_tokens, 16))
    budget = CUDA_TILESET_BYTES if device_type == "cuda" else CPU_TILESET_BYTES
    rows = budget // (4 * max(1, vocab))
    rows = rows - rows % 64 if rows >= 128 else max(1, rows)
    return max(1, min(num_tokens, rows))


class _TileSet:
    """The kept tiles of one token chunk and a spare tile for the GEMM's output, in one buffer that every
    chunk of the sweep reuses (the torch path: no allocation, hence no page faults, per tile)."""

    def __init__(self, rows: int, vocab: int, bv: int, dtype: torch.dtype, device: torch.device,
                 spares: int = 1):
        self.tiles = -(-vocab // bv)
        self.stride = rows * bv
        self.buf = torch.empty((self.tiles + spares) * self.stride, dtype=dtype, device=device)

    def tile(self, i: int, rows: int, width: int) -> torch.Tensor:
        """Slot i (i = tiles: the spare; tiles + 1: the softcap's second spare) as a contiguous [rows, width]
        tile."""
        return self.buf[i * self.stride : i * self.stride + rows * width].view(rows, width)


def _chunk_logprobs(ops, h_t, w, y_t, temperature, bv, tileset, softcap=None, row_tiled=False):
    """The chunk's kept tiles [(tile, m_tile or None)] and its logp, entropy, m, s, log s, d_y.

    Triton tiles (no tileset): z itself is kept, and the gradient kernel reads it once more. Torch tiles:
    e = exp(z/T - m_tile) is kept (tile_ops.tile_stats_exp), z computed into the spare slot; with a softcap
    e sech^2(z / c), e going through the second spare, and d_y [n] = sech^2 at the targets (else None)."""
    n, sdtype = h_t.shape[0], (torch.float64 if h_t.dtype == torch.float64 else torch.float32)
    m, s, u, z_y = (torch.empty(n, dtype=sdtype, device=h_t.device) for _ in range(4))
    d_y = torch.zeros(n, dtype=sdtype,
                      device=h_t.device) if softcap is not None and tileset is not None else None
    kept = []
    for i, v0 in enumerate(range(0, w.shape[0], bv)):
        w_c = w[v0 : v0 + bv]
        if tileset is None:
            z = tile_logits(h_t, w_c, row_tiled)
            ops.tile_stats(z, y_t - v0, (m, s, u, z_y), i == 0, temperature, True, keep_z=True,
                           softcap=softcap)
            kept.append((z, None))
        else:
            z = tile_logits(h_t, w_c, row_tiled, out=tileset.tile(tileset.tiles, n, w_c.shape[0]))
            e = tileset.tile(i, n, w_c.shape[0])
            if softcap is None:
                kept.append((e, ops.tile_stats_exp(z, y_t - v0, (m, s, u, z_y), i == 0, temperature, e)))
            else:
                scratch = tileset.tile(tileset.tiles + 1, n, w_c.shape[0])
                kept.append((e, ops.tile_stats_exp(z, y_t - v0, (m, s, u, z_y), i == 0, temperature, e,
                                                   softcap=softcap, scratch=scratch, d_y=d_y)))
    log_s = torch.log(s)
    return kept, (z_y - m) - log_s, log_s - u / s, (m, s, log_s, d_y)


def _chunk_grads(ops, kept, h_t, w, y_t, stats, g, temperature, bv, out, softcap=None):
    """dh of the chunk's rows into out[0] (a [C, H] view of dh, final dtype) and dW += dz^T h_t into
    out[1] (the fp32 accumulator), over the rows with g != 0. Each kept tile is turned into dz in place
    when the dot dtype is its own (fp32), else into one reused 16-bit buffer; both GEMMs accumulate inside."""
    dh_t, dw_acc = out
    act = torch.nonzero(g).squeeze(1)  # one host sync per chunk
    check_targets(y_t[act], w.shape[0])
    if dh_t is not None:
        dh_t.zero_()
    if act.numel() == 0:
        return
    dense = act.numel() == h_t.shape[0]
    pick = (lambda t: t) if dense else (lambda t: t.index_select(0, act))
    h_a, y_a, (m_a, s_a, log_s_a, d_y_a) = pick(h_t), pick(y_t), (None if t is None else pick(t)
                                                                  for t in stats)
    scale = fp16_scale(g[act], None, w.shape[0]) if h_t.dtype == torch.float16 else 1.0
    g_a = pick(g) * (scale / temperature)
    direct = dh_t is not None and dense and dh_t.dtype == m_a.dtype  # accumulate into dh itself
    dh_a = dh_t if direct or dh_t is None else torch.zeros(h_a.shape, dtype=m_a.dtype, device=h_t.device)
    in_place = h_t.dtype == m_a.dtype
    buf = None if in_place else torch.empty(h_a.shape[0] * bv, dtype=h_t.dtype, device=h_t.device)
    for i, v0 in enumerate(range(0, w.shape[0], bv)):
        w_c, (tile, m_tile) = w[v0 : v0 + bv], kept[i]
        kept[i] = None  # drop the chunk's tiles as they are used
        tile = pick(tile)
        if m_tile is not None:  # torch tiles hold e: one multiply, in place (always fp32/fp64 here)
            dz = ops.exp_tile_grad(tile, pick(m_tile), y_a - v0, m_a, s_a, g_a, d_y_a)
        else:  # the 16-bit buffer's first rows x width elements as a contiguous tile (the last is narrower)
            dst = tile if in_place else buf[: tile.numel()].view(tile.shape)
            dz = ops.tile_grad(tile, y_a - v0, (m_a, log_s_a, None), g_a, None, temperature, dst,
                               softcap=softcap)
        if dh_a is not None:
            mm_acc_(dh_a, dz, w_c, alpha=1.0 / scale)
        if dw_acc is not None:
            mm_acc_(dw_acc[v0 : v0 + bv], dz.T, h_a, alpha=1.0 / scale)
    if dh_a is not None and not direct:
        dh_t.index_copy_(0, act, dh_a.to(dh_t.dtype))


def _sweep(h, w, y, loss_fn, temperature, need, impl, plan, grad_dtypes, softcap=None):
    """(loss, logp, entropy, dh or None, dW or None) over the rows of h (already kept); dh and dW in
    grad_dtypes (the inputs' dtypes), dW through an fp32 accumulator only when its dtype is 16-bit."""
    ops, n = tile_ops_for(impl), h.shape[0]
    sdtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    logp, entropy = (torch.empty(n, dtype=sdtype, device=h.device) for _ in range(2))
    dh = torch.empty(h.shape, dtype=grad_dtypes[0], device=h.device) if need[0] else None
    dw = torch.zeros(w.shape, dtype=sdtype, device=h.device) if need[1] else None
    loss = torch.zeros((), dtype=sdtype, device=h.device)
    tileset = None if impl == "triton" else _TileSet(min(n, plan.chunk_tokens), w.shape[0], plan.chunk_vocab,
                                                     h.dtype, h.device, spares=1 if softcap is None else 2)
    for r0 in range(0, n, plan.chunk_tokens):
        rows = slice(r0, r0 + plan.chunk_tokens)
        h_t, y_t = h[rows], y[rows]
        kept, logp[rows], entropy[rows], stats = _chunk_logprobs(ops, h_t, w, y_t, temperature,
                                                                 plan.chunk_vocab, tileset, softcap,
                                                                 plan.row_tiled)
        idx = torch.arange(r0, r0 + h_t.shape[0], device=h.device)
        lp = logp[rows].detach().requires_grad_(any(need))
        with torch.enable_grad():
            chunk_loss = loss_fn(lp, idx)
        loss += chunk_loss.detach()
        if any(need) and chunk_loss.requires_grad:
            (g,) = torch.autograd.grad(chunk_loss, lp)
            _chunk_grads(ops, kept, h_t, w, y_t, stats, g.to(sdtype), temperature, plan.chunk_vocab,
                         (dh[rows] if need[0] else None, dw), softcap)
        elif need[0]:
            dh[rows].zero_()
        del kept
    if dw is not None and dw.dtype != grad_dtypes[1]:
        dw = dw.to(grad_dtypes[1])  # the fp32 accumulator is freed here, before backward
    return loss, logp, entropy, dh, dw


class _FusedTokenLoss(torch.autograd.Function):
    """loss with dh, dW formed in the forward; backward hands them on, scaled in place by the loss's
    upstream gradient (no second full-size buffer; no pass at all when that gradient is 1)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, loss_fn, temperature, impl, plan, softcap=None):
        dtype = operand_dtype(impl, hidden.dtype, weight.dtype)
        h, w = hidden.to(dtype).contiguous(), weight.to(dtype).contiguous()
        need = tuple(ctx.needs_input_grad[:2])
        loss, logp, entropy, dh, dw = _sweep(h, w, targets, loss_fn, temperature, need, impl, plan,
                                             (hidden.dtype, weight.dtype), softcap)
        ctx.grads = [dh, dw]  # not save_for_backward: handed on (and freed) by the one backward
        ctx.mark_non_differentiable(logp, entropy)
        return loss.to(torch.float64 if dtype == torch.float64 else torch.float32), logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        if ctx.grads is None:
            raise RuntimeError("fused_token_loss: backward through the same loss twice is not supported "
                               "(its gradients are handed on by the first backward)")
        dh, dw = ctx.grads
        ctx.grads = None
        if not bool(grad_loss == 1):  # one host sync; d(loss)/d(loss) = 1 is the usual case
            for grad in (dh, dw):
                if grad is not None:
                    grad.mul_(grad_loss.to(grad.dtype))
        return dh, dw, None, None, None, None, None, None


def fused_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: TokenLossFn,
    *,
    keep: torch.Tensor | None = None,
    temperature: float = 1.0,
    impl: str = "torch",
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    softcap: float | None = None,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A per-token loss of the LM head's log-probs, its gradient formed in the same sweep (module doc).

    hidden [N, H], weight [V, H], targets [N]. `loss_fn(logp, rows)` gets a chunk's log-probs [C]
    (fp32, differentiable) and their token indices in [0, N) and returns that chunk's scalar share of
    the loss: the loss must be a sum over tokens of terms that depend on the token's own log-prob (e.g.
    the DAPO token loss with a fixed normalizer). `keep` [N] bool drops rows (loss mask 0) before any
    work: their log-prob and entropy come back 0. Returns (loss, logp [N], entropy [N]); loss is
    differentiable in hidden and weight, logp and entropy are detached. `softcap` c (None or 0: off): the
    logits are c tanh(h W^T / c) / T, the cap before the temperature (softcap.py). `invariant`: each row's
    logits over whole invariant.TILE-row GEMM tiles, the vocabulary tiled by TILE_VOCAB: a token's log-prob
    is the bits chunked_token_logprobs(invariant=True) gives it, in any call.
    """
    n = hidden.shape[0]
    kept = torch.nonzero(keep).squeeze(1) if keep is not None else None  # one host sync
    if kept is not None and kept.numel() < n:
        inner = loss_fn
        loss_fn = lambda lp, rows: inner(lp, kept[rows])  # noqa: E731 - token indices of the caller
        h_k, y_k = hidden.index_select(0, kept), targets.index_select(0, kept)
    else:
        kept, h_k, y_k = None, hidden, targets
    device_type = "interpret" if impl == "triton" and hidden.device.type != "cuda" else hidden.device.type
    rows = chunk_tokens or fused_chunk_tokens(h_k.shape[0], weight.shape[0], device_type)
    tile_vocab = plan_chunks(rows, weight.shape[0],
                             "interpret").chunk_vocab if device_type == "interpret" else TILE_VOCAB
    if invariant:
        tile_vocab = INVARIANT_CHUNK_VOCAB  # as chunked_token_logprobs(invariant=True) tiles it, anywhere
    plan = Plan(rows, min(weight.shape[0], chunk_vocab or tile_vocab), row_tiled=invariant)
    loss, logp, entropy = _FusedTokenLoss.apply(h_k, weight, y_k, loss_fn, float(temperature), impl, plan,
                                                normalize_softcap(softcap))
    if kept is None:
        return loss, logp, entropy
    full = torch.zeros((2, n), dtype=logp.dtype, device=logp.device)
    full[0, kept], full[1, kept] = logp, entropy
    return loss, full[0], full[1]

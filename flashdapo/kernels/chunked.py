"""Chunked LM head -> per-token log-prob / entropy: one driver for impl="torch" and impl="triton".

The matrix multiplies are library calls (cuBLAS on CUDA, MKL/oneDNN on CPU); only the elementwise work
on each logit tile differs between the impls (`tile_ops`: torch ops; `triton_tiles`: Triton kernels).
The math and the chunk plan are written out in docs/kernels.md.

Forward, per vocabulary chunk c (fixed order) and token chunk t:
    z = h_t W_c^T (fp32 result), then one elementwise pass merges the tile's per-row online statistics
    (max, sum exp, sum p z, z_y) into the running ones. Only m, log s and the entropy are saved: O(N).
Backward, over the rows whose upstream gradient is not zero (one host sync compacts them), vocabulary
outer: per vocabulary chunk c (fixed order)
    recompute z tile by tile over the live rows; one elementwise pass forms dz (the one-hot term added in
    fp32) in the dot dtype into ONE buffer [live rows, chunk]; then dW_c = dz^T h as one GEMM over all live
    rows, written once in W's dtype, and dh += dz W_c accumulated inside the GEMM (fp32). Library GEMMs
    only, no fp32 dW slab, no separate add kernels, no atomics: same inputs, same bits.

Operands: impl="torch" computes in fp32 (fp64 when both inputs are fp64, for gradcheck); impl="triton"
in the inputs' dtype as autocast would pick it (bf16/fp16 tensor cores, fp32 results). fp16 dz is scaled
by a power of two before the cast so that realistic gradients (|g| ~ 1e-6) do not underflow; the scale
is divided out exactly, as the GEMMs' alpha on their fp32 accumulators.

Final-logit softcap c (Gemma): both passes see c tanh(z / c) / T, and the grad pass multiplies dz by
sech^2(z / c) per logit, inside the same pass (softcap.py; docs/kernels.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import tile_ops
from .gemm import HALF, mm_acc_, mm_f32, mm_into_
from .invariant import TILE, row_tiled_matmul
from .softcap import normalize_softcap

# Logit tile elements (token rows x vocabulary columns). CPU: 1 Mi fp32 elements (4 MiB) keep the
# elementwise passes in L2/L3 (measured: 0.5-1 Mi 2.85 s, 4 Mi 3.1 s, 16 Mi 3.7 s at N=8192, H=256,
# V=32768 on a 2-core EPYC; bench/results/NOTES.md), 512-row chunks are the dW matmul's K.
# CUDA: 32 Mi elements (128 MiB fp32 z) of 4096 vocabulary columns: GEMMs of M x 4096 x H and the
# backward's 4096 x H x N run near cuBLAS's peak at a few hundred MB of workspace.
CPU_TILE_ELEMS, CPU_CHUNK_TOKENS = 1 << 20, 512
CUDA_TILE_ELEMS, CUDA_CHUNK_VOCAB = 1 << 25, 4096
# The backward's dz buffer [live rows, vocabulary chunk]: its byte budget narrows the chunk (of forward
# and backward) when there are many rows (7B, N=16384: 4096 bf16 columns = 128 MiB; CPU fp32, N=8192:
# 512 columns = 16 MiB, tiles of 2048 x 512).
CPU_DZ_BYTES, CUDA_DZ_BYTES, MIN_BACKWARD_VOCAB = 16 << 20, 256 << 20, 256


# Batch-invariant sweeps (trainer.batch_invariant): every call tiles the vocabulary alike, whatever its
# number of rows, as the fused sweep does (fused.TILE_VOCAB), and computes each logit row in a GEMM over
# whole invariant.TILE-row tiles: a token's log-prob is then the same bits in a decode step of the rollout
# engine, in the old-log-prob pass and in the update's fused sweep.
INVARIANT_CHUNK_VOCAB = 4096


@dataclass(frozen=True)
class Plan:
    """Token rows and vocabulary columns of one logit tile; `row_tiled`: the batch-invariant GEMMs."""

    chunk_tokens: int
    chunk_vocab: int
    row_tiled: bool = False


def tile_logits(h: torch.Tensor, w_c: torch.Tensor, row_tiled: bool, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """z = h w_c^T for one tile (fp32 result for 16-bit operands), into `out` when given; `row_tiled`: over
    whole invariant.TILE-row tiles (a row's bits independent of the tile's other rows)."""
    if row_tiled:
        z = row_tiled_matmul(h if h.dtype not in HALF else h.float(), w_c.T if w_c.dtype not in HALF
                             else w_c.T.float())
        return out.copy_(z) if out is not None else z
    if out is not None:
        return torch.mm(h, w_c.T, out=out)
    return mm_f32(h, w_c.T)


def plan_chunks(num_tokens: int, vocab: int, device_type: str, tile_elems: int | None = None,
                dz_bytes: int = 4) -> Plan:
    """The tile of a call, for forward and backward alike: <= tile_elems elements (default per device), the
    whole vocabulary if it fits, and few enough columns that the backward's dz buffer [N, chunk] of
    `dz_bytes` elements stays within the device's budget (never below MIN_BACKWARD_VOCAB columns).

    Forward and backward use the same tiles so that the recomputed logits are bitwise the forward's: p is
    then consistent with the saved m and log s, which near-one-hot rows (T = 0.05) need, as 1 - p_y would
    otherwise carry the rounding difference of two GEMM shapes (~eps |z| / T)."""
    if device_type == "interpret":  # Triton's interpreter: tiny tiles, so tests cover every merge path
        return Plan(max(1, min(num_tokens, 16)), max(1, min(vocab, 32)))
    tile = tile_elems or (CUDA_TILE_ELEMS if device_type == "cuda" else CPU_TILE_ELEMS)
    budget = CUDA_DZ_BYTES if device_type == "cuda" else CPU_DZ_BYTES
    fit = max(MIN_BACKWARD_VOCAB, budget // max(1, num_tokens * dz_bytes))
    widest = CUDA_CHUNK_VOCAB if device_type == "cuda" else tile // max(1, min(num_tokens, CPU_CHUNK_TOKENS))
    bv = max(1, min(vocab, widest, fit))
    return Plan(max(1, min(num_tokens, tile // bv)), bv)


def operand_dtype(impl: str, h_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """Matmul operand dtype. torch: fp32 (fp64 if both are fp64). triton: as autocast would pick it, a
    16-bit operand wins over an fp32/fp64 one; equal dtypes stay; fp64 and a bf16/fp16 mix run fp32."""
    if impl == "torch":
        return torch.float64 if h_dtype == w_dtype == torch.float64 else torch.float32
    if h_dtype == w_dtype:
        return torch.float32 if h_dtype == torch.float64 else h_dtype
    if (h_dtype in HALF) != (w_dtype in HALF):
        return h_dtype if h_dtype in HALF else w_dtype
    return torch.float32


def tile_ops_for(impl: str):
    """The tile operations of `impl`: the Triton passes, or their torch reference (the chunked torch path)."""
    if impl == "triton":
        from . import triton_tiles

        return triton_tiles
    return tile_ops


def _forward(h, w, y, temperature, with_entropy, plan, impl, softcap=None):
    """logp, entropy (or None), m, log s: [N] each, fp32 (fp64 for the fp64 torch path); of the logits
    softcap tanh(h W^T / softcap) / T with a cap."""
    ops, n, vocab = tile_ops_for(impl), h.shape[0], w.shape[0]
    sdtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    m, s, u, z_y = (torch.empty(n, dtype=sdtype, device=h.device) for _ in range(4))
    for v0 in range(0, vocab, plan.chunk_vocab):  # fixed order: the merge is deterministic
        w_c, y_local = w[v0 : v0 + plan.chunk_vocab], y - v0
        for r0 in range(0, n, plan.chunk_tokens):
            rows = slice(r0, r0 + plan.chunk_tokens)
            z = tile_logits(h[rows], w_c, plan.row_tiled)
            ops.tile_stats(z, y_local[rows], (m[rows], s[rows], u[rows], z_y[rows]), v0 == 0, temperature,
                           with_entropy, softcap=softcap)
    log_s = torch.log(s)
    logp = (z_y - m) - log_s  # <= 0: z_y is one of the values that made m, and s >= 1
    entropy = log_s - u / s if with_entropy else None
    return logp, entropy, m, log_s


def fp16_scale(g, ge, vocab: int) -> float:
    """Power of two that lifts max |dz| to ~2^14 in fp16. |dz| <= |g| + |gH| (log V + 1): p <= 1 and
    p |log p + entropy| <= 1/e + log V."""
    bound = g.abs().max() + (ge.abs().max() * (math.log(vocab) + 1) if ge is not None else 0)
    bound = float(bound)  # one host sync (fp16 only)
    return 2.0 ** math.floor(math.log2(2.0**14 / bound)) if bound > 0 else 1.0


def _active_rows(grad_logp, grad_ent, n, device):
    active = torch.zeros(n, dtype=torch.bool, device=device)
    for grad in (grad_logp, grad_ent):
        if grad is not None:
            active |= grad != 0
    return torch.nonzero(active).squeeze(1)  # one host sync: sizes the work to the rows that need it


def check_targets(y_act: torch.Tensor, vocab: int) -> None:
    """ValueError if an active row's target lies outside [0, V): its one-hot term would be lost."""
    if y_act.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(y_act)).tolist())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"target {bad} of a row with nonzero gradient is outside [0, V={vocab}); "
                         "give ignored rows (e.g. target -100) a zero upstream gradient")


def _grad_scale(g, ge, temperature, fp16: bool, vocab: int):
    """(g, ge) multiplied by scale / T, and 1 / scale: the GEMMs' alpha that divides the scale out."""
    scale = fp16_scale(g, ge, vocab) if fp16 and g.numel() else 1.0
    g = g * (scale / temperature)  # 1/T of dz and the fp16 scale: N multiplies, not N V
    return g, (ge * (scale / temperature) if ge is not None else None), 1.0 / scale


def _backward(h, w, y, stats, grad_logp, grad_ent, temperature, need, plan, impl, softcap=None):
    """dh [n_act, H] (fp32/fp64) or None, dW [V, H] in w's dtype (each chunk written once) or None, and
    the active rows. Vocabulary outer: per chunk, dz of all live rows goes into one buffer, then
    dW[chunk] = dz^T h (one GEMM, K = live rows) and dh += dz W[chunk] (accumulated in the GEMM)."""
    ops, vocab = tile_ops_for(impl), w.shape[0]
    rows = _active_rows(grad_logp, grad_ent, h.shape[0], h.device)
    y_a = y[rows]
    check_targets(y_a, vocab)
    dense = rows.numel() == h.shape[0]
    h_a = h if dense else h[rows]
    m, log_s, ent = (None if t is None else (t if dense else t[rows]) for t in stats)
    zeros = torch.zeros(rows.numel(), dtype=m.dtype, device=h.device)
    g = grad_logp.to(m.dtype)[rows] if grad_logp is not None else zeros
    ge = grad_ent.to(m.dtype)[rows] if grad_ent is not None else None
    g, ge, alpha = _grad_scale(g, ge, temperature, h.dtype == torch.float16, vocab)
    n_act, hdim = h_a.shape
    dh = torch.zeros((n_act, hdim), dtype=m.dtype, device=h.device) if need[0] else None
    dw = (torch.empty_like(w) if n_act else torch.zeros_like(w)) if need[1] else None
    if n_act == 0:
        return dh, dw, rows
    bv, bn = plan.chunk_vocab, plan.chunk_tokens  # the forward's tiles: the same z, bit for bit
    dz_buf = torch.empty(n_act * bv, dtype=h.dtype, device=h.device)
    in_place = h.dtype == m.dtype  # fp32/fp64 dz: the GEMM writes z into the buffer, the pass overwrites it
    for v0 in range(0, vocab, bv):
        w_c, y_local = w[v0 : v0 + bv], y_a - v0
        dz = dz_buf[: n_act * w_c.shape[0]].view(n_act, w_c.shape[0])
        for r0 in range(0, n_act, bn):
            r = slice(r0, r0 + bn)
            z = tile_logits(h_a[r], w_c, plan.row_tiled, out=dz[r] if in_place else None)
            ops.tile_grad(z, y_local[r], (m[r], log_s[r], None if ge is None else ent[r]), g[r],
                          None if ge is None else ge[r], temperature, dz[r], softcap=softcap)
            del z
        if need[1]:
            mm_into_(dw[v0 : v0 + bv], dz.T, h_a, alpha)
        if need[0]:
            mm_acc_(dh, dz, w_c, alpha)
    return dh, dw, rows


class _ChunkedLogprobs(torch.autograd.Function):
    """(logp, entropy) with per-token statistics saved; logits recomputed in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, plan, impl, softcap=None):
        # An output whose gradient is not needed (the entropy, in the DAPO loss) reaches backward as None,
        # not as zeros: its term is then skipped instead of computed on zeros.
        ctx.set_materialize_grads(False)
        dtype = operand_dtype(impl, hidden.dtype, weight.dtype)
        h, w = hidden.to(dtype).contiguous(), weight.to(dtype).contiguous()
        logp, entropy, m, log_s = _forward(h, w, targets, temperature, with_entropy, plan, impl, softcap)
        ctx.save_for_backward(hidden, weight, targets, m, log_s, entropy)
        ctx.temperature, ctx.plan, ctx.impl, ctx.softcap = temperature, plan, impl, softcap
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets, m, log_s, entropy = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        dh_out = None
        if not any(need) or (grad_logp is None and grad_ent is None):
            zeros = torch.zeros_like(hidden) if need[0] else None
            return zeros, (torch.zeros_like(weight) if need[1] else None), None, None, None, None, None, None
        dtype = operand_dtype(ctx.impl, hidden.dtype, weight.dtype)
        h, w = hidden.to(dtype).contiguous(), weight.to(dtype).contiguous()
        dh, dw, rows = _backward(h, w, targets, (m, log_s, entropy), grad_logp, grad_ent, ctx.temperature,
                                 need, ctx.plan, ctx.impl, ctx.softcap)
        if need[0] and rows.numel() == hidden.shape[0]:
            dh_out = dh.to(hidden.dtype)  # every row live: no scatter (no copy at all for fp32)
        elif need[0]:
            dh_out = torch.zeros_like(hidden).index_copy_(0, rows, dh.to(hidden.dtype))
        return dh_out, (dw.to(weight.dtype) if need[1] else None), None, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    impl: str = "torch",
    tile_elems: int | None = None,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    softcap: float | None = None,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) [N] and optionally entropy [N], fp32 (fp64 for fp64 inputs and impl="torch").

    hidden [N, H], weight [V, H], targets [N] in [0, V) on every row with a nonzero upstream gradient
    (else backward raises ValueError; other rows may carry any target and get a meaningless log-prob).
    Differentiable in hidden and weight through both outputs (upstream gradients of any sign; None for
    either is fine); gradients come back in each input's dtype. `impl` picks the elementwise passes
    ("torch" or "triton": CUDA, or CPU under TRITON_INTERPRET=1); `tile_elems`, `chunk_tokens`,
    `chunk_vocab` override the chunk plan (tests use them to cover multi-chunk paths on tiny shapes).
    `softcap` c (None or 0: off): the logits are c tanh(h W^T / c) / T, the cap before the temperature.
    `invariant`: a row's results do not depend on the other rows of the call (INVARIANT_CHUNK_VOCAB).
    """
    device_type = hidden.device.type
    if impl == "triton" and device_type != "cuda":
        from .triton_tiles import INTERPRET

        if not INTERPRET:
            raise RuntimeError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before importing "
                               "triton (CPU, small shapes only); use impl='torch' on CPU")
        device_type = "interpret"
    dz_bytes = operand_dtype(impl, hidden.dtype, weight.dtype).itemsize
    plan = plan_chunks(hidden.shape[0], weight.shape[0], device_type, tile_elems, dz_bytes)
    plan = Plan(max(1, chunk_tokens or plan.chunk_tokens),
                max(1, min(weight.shape[0], chunk_vocab or plan.chunk_vocab)))
    if invariant:  # the vocabulary tiled as in every other call; rows in chunks of whole GEMM tiles
        plan = Plan(max(TILE, plan.chunk_tokens - plan.chunk_tokens % TILE),
                    min(weight.shape[0], chunk_vocab or INVARIANT_CHUNK_VOCAB), row_tiled=True)
    return _ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), bool(with_entropy), plan, impl,
                                  normalize_softcap(softcap))


@torch.no_grad()
def chunked_token_probe_stats(
        hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
        impl: str = "torch", tile_elems: int | None = None,
        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """No-grad (logp, entropy, top-1 probability) per token [N] from the forward's online statistics.

    The top-1 probability is exp(max z/T - lse) = exp(m - m - log s) = 1 / s: the forward's own running
    max m and sum s give it, so nothing beyond the `token_logprobs` forward runs and no logits are kept."""
    device_type = hidden.device.type
    if impl == "triton" and device_type != "cuda":
        from .triton_tiles import INTERPRET

        if not INTERPRET:
            raise RuntimeError(
                "impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before importing triton")
        device_type = "interpret"
    dtype = operand_dtype(impl, hidden.dtype, weight.dtype)
    plan = plan_chunks(hidden.shape[0], weight.shape[0], device_type, tile_elems, dtype.itemsize)
    h, w = hidden.to(dtype).contiguous(), weight.to(dtype).contiguous()
    logp, entropy, _, log_s = _forward(h, w, targets, float(temperature), True, plan, impl,
                                       normalize_softcap(softcap))
    return logp, entropy, torch.exp(-log_s)

"""Batch-invariant building blocks: a row's result does not depend on which other rows share the call.

The rollout engine computes a token's hidden state in a decode step (a few rows, the earlier positions read
from a KV cache); the trainer recomputes it in a packed or padded forward of thousands of rows. The two agree
bit for bit only if every operation gives a row the same result whatever the other rows are. Elementwise
operations and reductions along the last (contiguous) dimension already do on this CPU; two things do not:

- **Matrix multiplies.** A GEMM's summation order depends on the shape it is called with: a 1-row call (a
  GEMV) and a 512-row call give a row different roundings (measured on the project's 2-core CPU: 0 of 512
  rows equal).
  `invariant_linear` computes every row inside a tile of `TILE` rows: the rows are zero-padded to a multiple
  of `TILE`, so the library is never called with fewer rows than a tile, and a row's result does not depend on
  its neighbours (`gemm_is_row_invariant` checks that on the machine a run starts on).
- **Attention.** Its sums over keys (the softmax denominator, the weighted values) run over as many keys as
  the call holds. `invariant_attention` walks the keys of each query in blocks of `TILE` positions anchored at
  the first key the query may see (its document's start, wherever the document sits in the row or the cache),
  adding the blocks one after the other: a query meets the same blocks in the same order in a decode step over
  its cache and in a packed forward over its document. Blocks past the query's last key are all masked; they
  add exact zeros. The scores q.k are sums along the head dimension (contiguous), the block sums along the
  block's `TILE` keys.

What they move and compute: `invariant_linear` reads x [N, in] and W [out, in] once (plus the padding, under
`TILE` rows) and writes [N, out], the FLOPs of the plain matmul. `invariant_attention` reads q [B, H, Tq, D]
and, per key block, gathers the block's keys and values for every query ([B, Tq, H, TILE, D] each), so it
moves TILE x D values per query and block: the attention FLOPs of a dense causal forward over each query's own
document, without a [Tq, Tk] mask, at elementwise (not GEMM) speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE = 16
"""Rows per GEMM tile and keys per attention block."""

__all__ = ["TILE", "attention_extents", "gemm_is_row_invariant", "invariant_attention", "invariant_linear",
           "row_tiled_matmul"]


def row_tiled_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] with the rows of `a` zero-padded to whole tiles of `TILE` rows, so that the library
    GEMM is never called with fewer rows than a tile (module docstring). Differentiable."""
    n = a.shape[0]
    pad = (-n) % TILE
    if pad:
        a = F.pad(a, (0, 0, 0, pad))
    out = torch.matmul(a.view(-1, TILE, a.shape[1]), b).reshape(-1, b.shape[1])
    return out[:n] if pad else out


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) with every row computed in a GEMM over whole tiles of `TILE` rows: x [..., in],
    weight [out, in] -> [..., out]; a row's result does not depend on the number of rows (module docstring).
    Differentiable."""
    out = row_tiled_matmul(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def gemm_is_row_invariant(dtype: torch.dtype, device: torch.device | str = "cpu", width: int = 64,
                          rows: int = 256, seed: int = 0) -> bool:
    """Whether `invariant_linear` gives each of `rows` random rows the same bits alone (one tile) as among all
    of them, in `dtype` on `device`: the property batch-invariant runs rest on, checked where they run."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(width + 8, width, generator=gen).to(device=device, dtype=dtype)
    full = invariant_linear(x, w)
    return all(torch.equal(invariant_linear(x[i:i + 1], w)[0], full[i]) for i in range(0, rows, 7))


def attention_extents(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first key, number of keys) per query of a boolean mask `allowed` [..., Tq, Tk] whose True keys form
    one contiguous run per query (a causal document: packed, left- or right-padded, or over a KV cache).
    ValueError where a query's keys are not contiguous (a sliding window past its start, say)."""
    count = allowed.sum(-1)
    first = allowed.int().argmax(-1)
    positions = torch.arange(allowed.shape[-1], device=allowed.device)
    inside = (positions >= first[..., None]) & (positions < (first + count)[..., None])
    if not torch.equal(inside, allowed):
        raise ValueError("batch-invariant attention needs each query's keys to be one contiguous run from "
                         "its document's start (causal attention without a sliding window)")
    return first, count


def invariant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: torch.Tensor,
                        count: torch.Tensor, scaling: float) -> torch.Tensor:
    """softmax(q k^T * scaling) v of each query over its own keys `first` .. `first + count - 1`, in key
    blocks of `TILE` anchored at `first` (module docstring).

    query [B, H, Tq, D], key and value [B, Hkv, Tk, D] (H a multiple of Hkv: grouped-query heads), first
    and count [B, Tq] -> [B, Tq, H, D] (transformers' attention-output layout), in the query's dtype with
    fp32 sums. A query with no keys gets zeros."""
    batch, heads, tq, dim = query.shape
    kv_heads, tk, vdim = key.shape[1], key.shape[2], value.shape[-1]
    group = heads // kv_heads
    # [B, Tq, 1, Hkv, group, D]: broadcast over a block's keys; a key head serves its group of query heads
    q = query.transpose(1, 2).float().reshape(batch, tq, 1, kv_heads, group, dim)
    keys, values = key.transpose(1, 2).float(), value.transpose(1, 2).float()  # [B, Tk, Hkv, D]
    offsets = torch.arange(TILE, device=query.device)
    blocks = -(-int(count.max()) // TILE) if count.numel() else 0
    # One document a row (left- or right-padded rows, a decode step): a block's keys are gathered once a row
    # and broadcast over its queries, the same values a per-query gather gives.
    shared = bool((first == first[:, :1]).all()) if tq > 1 else True
    anchors = first[:, :1] if shared else first
    rows = torch.arange(batch, device=query.device)[:, None, None]

    def block(source: torch.Tensor, b: int) -> torch.Tensor:
        """Block b's keys (or values) for every query: [B, Tq or 1, TILE, Hkv, 1, D]."""
        index = (anchors[..., None] + b * TILE + offsets).clamp(max=tk - 1)
        return source[rows, index].unsqueeze(-2)

    scores = []
    for b in range(blocks):
        valid = (b * TILE + offsets) < count[..., None]  # [B, Tq, TILE]
        s = (q * block(keys, b)).sum(-1) * scaling  # [B, Tq, TILE, Hkv, group]: sums along D
        scores.append(s.masked_fill(~valid[:, :, :, None, None], float("-inf")))
    out = torch.zeros(batch, tq, kv_heads, group, vdim, device=query.device)
    if not blocks:
        return out.reshape(batch, tq, heads, vdim).to(query.dtype)
    peak = torch.stack([s.amax(2) for s in scores], -1).amax(-1)  # [B, Tq, Hkv, group]: exact in any order
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = torch.zeros(batch, tq, kv_heads, group, device=query.device)
    for b, s in enumerate(scores):
        p = torch.exp(s - peak[:, :, None])  # masked keys: exp(-inf) = 0
        total = total + p.sum(2)  # along the block's keys, then block after block
        out = out + (p[..., None] * block(values, b)).sum(2)
    out = out / torch.where(total == 0, torch.ones_like(total), total)[..., None]
    return out.reshape(batch, tq, heads, vdim).to(query.dtype)

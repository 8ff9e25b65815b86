"""The per-tile elementwise passes of the chunked driver, as torch ops (any device; the CPU path).

A tile is z = h_t W_c^T for a token chunk t and a vocabulary chunk c, in fp32 (fp64 for fp64 inputs),
before the division by the temperature. Two passes read it:

- `tile_stats`: merge the tile's per-row online statistics into the running ones of its rows, in place:
  m (max of z/T), s = sum exp(z/T - m), u = sum exp(z/T - m) (z/T - m), z_y (the target's logit, -inf
  until the chunk holding it is seen). u is kept relative to the running max, so the entropy
  log s - u / s needs no cancellation of large terms and is >= 0 (u <= 0).
- `tile_grad`: dz = g (onehot(y) - p) + gH p (E_p[z] - z) of the tile, with g and gH already divided by
  T. log p = (z/T - m) - log s, not z/T - lse: lse = m + log s rounds to eps |m|, which at T = 0.05
  (|z/T| ~ 1e3) would put a 1e-4 relative error on p.

With a final-logit softcap c (`softcap.py`) both passes work on c tanh(z / c) / T instead of z / T, and
`tile_grad` multiplies dz by sech^2(z / c) per logit (the gradient w.r.t. the raw z); without one, they
run exactly the ops they ran before the cap existed.

`flashdapo.kernels.triton_tiles` implements the same two functions as Triton kernels (one read of z,
one write of dz); the driver picks one module per call.

The fused sweep (`fused.py`) keeps a token chunk's tiles between its two passes. On this path it keeps
e = exp(z/T - m_tile) instead of z (`tile_stats_exp`), so that its gradient pass is one multiply by a
per-row factor (`exp_tile_grad`): one exp per logit instead of two, three fewer passes over the tile.
"""

from __future__ import annotations

import torch

from .softcap import cap_


def tile_stats(z, y_local, state, first: bool, temperature: float, with_entropy: bool,
               keep_z: bool = False, softcap: float | None = None) -> None:
    """Merge the statistics of tile z [n, bv] into state = (m, s, u, z_y), each [n], in place.

    y_local [n] are the targets minus the chunk's first column (outside [0, bv): the target lies in
    another chunk). z is overwritten unless `keep_z` (then one temporary tile is used instead: the fused
    sweep keeps its tiles for the gradient pass). u is None when `with_entropy` is off. `softcap` c: the
    statistics are those of c tanh(z / c) / T (softcap.py).
    """
    scaled = temperature != 1.0 or softcap is not None
    if softcap is not None:  # on a copy when keep_z: z is ours from here on, like z / T below
        z, keep_z = cap_(z.clone() if keep_z else z, softcap, temperature), False
    elif scaled:
        z = z.div(temperature) if keep_z else z.div_(temperature)
    zy2 = _target_logit(z, y_local)
    m2 = z.amax(dim=1)
    # z - m2 <= 0 from here on
    z = z.sub(m2.unsqueeze(1)) if keep_z and not scaled else z.sub_(m2.unsqueeze(1))
    if with_entropy:
        e = torch.exp(z)
        # vecdot, not a batched GEMV: its sum is blocked (pairwise), a GEMV's sequential one lost up to
        # 3x naive's entropy error at V = 1009.
        u2, s2 = torch.linalg.vecdot(e, z, dim=1), e.sum(dim=1)
    else:
        s2, u2 = z.exp_().sum(dim=1), None
    _merge(state, m2, s2, u2, zy2, first)


def _merge(state, m2, s2, u2, zy2, first: bool) -> None:
    """Fold one tile's row statistics into the running ones (u, u2 None: no entropy)."""
    m, s, u, z_y = state
    with_entropy = u2 is not None
    if first:
        m.copy_(m2), s.copy_(s2), z_y.copy_(zy2)
        if with_entropy:
            u.copy_(u2)
        return
    m_new = torch.maximum(m, m2)
    a, b = torch.exp(m - m_new), torch.exp(m2 - m_new)
    if with_entropy:
        u.copy_(a * (u + (m - m_new) * s) + b * (u2 + (m2 - m_new) * s2))
    s.copy_(a * s + b * s2)
    m.copy_(m_new)
    torch.maximum(z_y, zy2, out=z_y)


def _target_logit(z, y_local):
    """z[row, y] of rows whose target lies in this tile, -inf for the others."""
    inside = (y_local >= 0) & (y_local < z.shape[1])
    zy = z.gather(1, y_local.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    return torch.where(inside, zy, torch.full_like(zy, float("-inf")))


def tile_stats_exp(z, y_local, state, first: bool, temperature: float, out: torch.Tensor,
                   softcap: float | None = None, scratch: torch.Tensor | None = None,
                   d_y: torch.Tensor | None = None) -> torch.Tensor:
    """`tile_stats` with entropy for the fused sweep: merges the tile's statistics into state and writes
    e = exp(z/T - m_tile) into `out` (z's shape, another buffer); z is overwritten with z/T - m_tile.
    Returns m_tile [n], which `exp_tile_grad` needs to turn e into p. Moves: z read 5x and written 3x,
    out written once and read twice (the sum and the entropy's product), one exp per logit, no temporary.

    `softcap` c: the statistics are those of z' = c tanh(z / c) / T, and `out` receives e sech^2(z / c)
    (the derivative folded in: the gradient pass stays one multiply); e itself goes through `scratch`
    (z's shape, a third buffer), and d_y [n] gets sech^2 at the target's column for the rows whose target
    lies in this tile (the one-hot term's factor)."""
    if softcap is not None:
        cap_(z, softcap, temperature, deriv=out)  # out = sech^2(z / c) until it is multiplied by e below
        inside = (y_local >= 0) & (y_local < z.shape[1])
        d_at_y = out.gather(1, y_local.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
        torch.where(inside, d_at_y, d_y, out=d_y)
    elif temperature != 1.0:
        z.div_(temperature)
    zy2 = _target_logit(z, y_local)
    m2 = z.amax(dim=1)
    z.sub_(m2.unsqueeze(1))
    e = torch.exp(z, out=out if softcap is None else scratch)
    s2, u2 = e.sum(dim=1), z.mul_(e).sum(dim=1)  # u in z's storage: no temporary; sum is blocked too
    if softcap is not None:
        out.mul_(e)
    _merge(state, m2, s2, u2, zy2, first)
    return m2


def exp_tile_grad(e, m_tile, y_local, m, s, g, d_y=None) -> torch.Tensor:
    """dz = g (onehot(y) - p) of a tile kept by `tile_stats_exp`, in e's storage, returned: p = e
    exp(m_tile - m) / s, one multiply by a per-row factor (exactly 1 / s where the tile holds the row's max,
    so a near-one-hot row at T = 0.05 gets p_y from the same e that went into s). g [n] is divided by T.
    With a softcap the tile holds e sech^2 and d_y [n] is sech^2 at the target: dz = -g p sech^2 +
    onehot(y) g d_y, the gradient w.r.t. the raw logits."""
    dz = e.mul_((-g * torch.exp(m_tile - m) / s).unsqueeze(1))
    inside = (y_local >= 0) & (y_local < e.shape[1])  # no host sync: rows elsewhere add 0 at a clamped column
    one_hot = torch.where(inside, g if d_y is None else g * d_y, torch.zeros_like(g)).unsqueeze(1)
    return dz.scatter_add_(1, y_local.clamp(0, e.shape[1] - 1).unsqueeze(1), one_hot)


def tile_grad(z, y_local, rowstats, g, ge, temperature: float, out: torch.Tensor,
              softcap: float | None = None) -> torch.Tensor:
    """dz of tile z [n, bv] (overwritten) into `out` [n, bv] (z itself, or a 16-bit buffer), returned;
    the one-hot term g is added at column y in z's dtype before any cast.

    rowstats = (m, log s, entropy or None) [n]; g, ge [n] the upstream gradients of logp and entropy
    divided by T (ge None: no entropy term). `softcap` c: the statistics are those of c tanh(z / c) / T and
    dz, the gradient w.r.t. the raw z, is the capped logits' one times sech^2(z / c) (one temporary tile).
    """
    m, log_s, ent = rowstats
    deriv = None
    if softcap is not None:
        deriv = torch.empty_like(z)
        cap_(z, softcap, temperature, deriv=deriv)
    elif temperature != 1.0:
        z.div_(temperature)
    if ge is None:  # p = exp(z - m) / s: three passes over the tile instead of four
        dz = z.sub_(m.unsqueeze(1)).exp_().mul_((-g * torch.exp(-log_s)).unsqueeze(1))
    else:
        t = z.sub_(m.unsqueeze(1)).sub_(log_s.unsqueeze(1))  # log p
        coef = torch.add(t, ent.unsqueeze(1)).mul_(-ge.unsqueeze(1)).sub_(g.unsqueeze(1))
        dz = t.exp_().mul_(coef)  # in z's storage
    inside = (y_local >= 0) & (y_local < z.shape[1])  # no host sync: rows elsewhere add 0 at a clamped column
    one_hot = torch.where(inside, g, torch.zeros_like(g)).unsqueeze(1)
    dz.scatter_add_(1, y_local.clamp(0, z.shape[1] - 1).unsqueeze(1), one_hot)
    if deriv is not None:
        dz.mul_(deriv)
    return dz if out is dz else out.copy_(dz)

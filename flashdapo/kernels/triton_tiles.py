"""The per-tile elementwise passes of the chunked driver as Triton kernels (the CUDA path).

Same contract as `flashdapo.kernels.tile_ops` (read its docstring for the math); the matrix multiplies
around them are library calls. Each kernel reads the fp32 logit tile once; `tile_grad` writes dz once in
the dot dtype, the one-hot term g added at column y in fp32 before that cast. A program owns BLOCK_R
rows and walks their columns in BLOCK_V steps, so a row's result never depends on other rows, and the
running statistics of a row are merged chunk after chunk in the driver's fixed order (no atomics).

On a machine without a GPU the kernels run under TRITON_INTERPRET=1 (set before triton is imported).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of both kernels: rows per program, columns per step, warps."""

    block_r: int
    block_v: int
    num_warps: int


# GPU: 4 rows x 1024 columns of fp32 per step (16 KB in flight per program, 8 warps: 16 B per thread
# per load), a pure streaming pass. Interpreter: one program per 16 rows keeps the program count low.
GPU_CONFIG = TileConfig(block_r=4, block_v=1024, num_warps=8)
INTERPRET_CONFIG = TileConfig(block_r=16, block_v=64, num_warps=1)


def config() -> TileConfig:
    return INTERPRET_CONFIG if INTERPRET else GPU_CONFIG


@triton.jit
def _tanh_sech2(a, WITH_SECH2: tl.constexpr):
    """(tanh a, sech^2 a) of an fp32 block (sech^2 only if WITH_SECH2, else 0), from tl ops alone (the
    interpreter has no libdevice): |a| < 0.625 Cephes tanhf's odd polynomial (relative error < 1.3e-7),
    sech^2 = 1 - t^2 >= 0.69 there; beyond, q = exp(-2|a|): tanh = (1 - q) / (1 + q), sech^2 = 4 q / (1 +
    q)^2, both relative-accurate however far tanh saturates (1 - t^2 would be 0 in fp32 past |a| ~ 9).
    One exp and one reciprocal a logit, no branch (both forms, then a select)."""
    ax = tl.abs(a)
    q = tl.exp(-2.0 * ax)
    r = 1.0 / (1.0 + q)
    a2 = a * a
    poly = ((((-5.70498872745e-3 * a2 + 2.06390887954e-2) * a2 - 5.37397155531e-2) * a2
             + 1.33314422036e-1) * a2 - 3.33332819422e-1) * a2
    small = ax < 0.625
    t_abs = tl.where(small, ax + ax * poly, (1.0 - q) * r)
    t = tl.where(a < 0, -t_abs, t_abs)
    if WITH_SECH2:
        d = tl.where(small, 1.0 - t_abs * t_abs, 4.0 * q * r * r)
    else:
        d = tl.zeros_like(a)
    return t, d


@triton.jit
def _stats_kernel(z_ptr, y_ptr, m_ptr, s_ptr, u_ptr, zy_ptr, n, bv, temperature, softcap,
                  FIRST: tl.constexpr, WITH_ENT: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """Online (max, sum exp, sum exp * (z - max), z_y) of BLOCK_R rows of one tile, merged into the
    running statistics: reads 4 bv bytes and 20 bytes a row, writes 16 bytes a row. SOFTCAP: of the
    logits softcap tanh(z / softcap) / T (same bytes; one more exp and a reciprocal a logit)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    base = rows.to(tl.int64) * bv
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_R,), tl.float32)
    u = tl.zeros((BLOCK_R,), tl.float32)
    z_y = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for c0 in range(0, bv, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols < bv)[None, :]
        if SOFTCAP:
            z, _ = _tanh_sech2(tl.load(z_ptr + base[:, None] + cols[None, :], mask=ok, other=0.0) / softcap,
                               False)
            z = z * (softcap / temperature)
        else:
            z = tl.load(z_ptr + base[:, None] + cols[None, :], mask=ok, other=0.0) / temperature
        # Padded columns never enter max or sum (V prime, all-negative logits).
        m_new = tl.maximum(m, tl.max(tl.where(ok, z, float("-inf")), axis=1))
        m_new = tl.where(row_ok, m_new, 0.0)  # padded rows: finite, never stored
        zs = tl.where(ok, z - m_new[:, None], 0.0)
        e = tl.where(ok, tl.exp(zs), 0.0)
        if WITH_ENT:
            shift = (tl.where(s > 0, m, m_new) - m_new) * s  # not -inf * 0 on the first step
            u = tl.exp(m - m_new) * (u + shift) + tl.sum(e * zs, axis=1)
        s = tl.exp(m - m_new) * s + tl.sum(e, axis=1)
        z_y = tl.maximum(z_y, tl.max(tl.where(ok & (cols[None, :] == y[:, None]), z, float("-inf")), axis=1))
        m = m_new
    if not FIRST:  # merge with the chunks before, in the driver's order
        m0 = tl.load(m_ptr + rows, mask=row_ok, other=0.0)
        s0 = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
        m_new = tl.maximum(m0, m)
        a, b = tl.exp(m0 - m_new), tl.exp(m - m_new)
        if WITH_ENT:
            u0 = tl.load(u_ptr + rows, mask=row_ok, other=0.0)
            u = a * (u0 + (m0 - m_new) * s0) + b * (u + (m - m_new) * s)
        s = a * s0 + b * s
        m = m_new
        z_y = tl.maximum(z_y, tl.load(zy_ptr + rows, mask=row_ok, other=0.0))
    tl.store(m_ptr + rows, m, mask=row_ok)
    tl.store(s_ptr + rows, s, mask=row_ok)
    tl.store(zy_ptr + rows, z_y, mask=row_ok)
    if WITH_ENT:
        tl.store(u_ptr + rows, u, mask=row_ok)


@triton.jit
def _grad_kernel(z_ptr, dz_ptr, y_ptr, g_ptr, ge_ptr, m_ptr, log_s_ptr, ent_ptr, n, bv, temperature, softcap,
                 HAS_GE: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """dz = g (onehot - p) + gH p (-entropy - log p) of BLOCK_R rows: reads 4 bv bytes a row, writes
    bv elements of dz's dtype a row (the one-hot term added in fp32 before the cast). SOFTCAP: p of the
    logits softcap tanh(z / softcap) / T, and dz times sech^2(z / softcap) (w.r.t. the raw z; same bytes)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    m = tl.load(m_ptr + rows, mask=row_ok, other=0.0)
    log_s = tl.load(log_s_ptr + rows, mask=row_ok, other=0.0)
    coef = -g[:, None]
    if HAS_GE:
        ge = tl.load(ge_ptr + rows, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
    base = rows.to(tl.int64) * bv
    for c0 in range(0, bv, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols < bv)[None, :]
        if SOFTCAP:
            z, d = _tanh_sech2(tl.load(z_ptr + base[:, None] + cols[None, :], mask=ok, other=0.0) / softcap,
                               True)
            z = z * (softcap / temperature)
        else:
            z = tl.load(z_ptr + base[:, None] + cols[None, :], mask=ok, other=0.0) / temperature
        t = (z - m[:, None]) - log_s[:, None]
        if HAS_GE:
            dz = tl.exp(t) * (ge[:, None] * (-ent[:, None] - t) + coef)
        else:
            dz = tl.exp(t) * coef
        dz += tl.where(cols[None, :] == y[:, None], g[:, None], 0.0)
        if SOFTCAP:
            dz = dz * d
        tl.store(dz_ptr + base[:, None] + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=ok)


def _launch_args(n: int) -> tuple[tuple[int], dict]:
    c = config()
    return (triton.cdiv(n, c.block_r),), dict(BLOCK_R=c.block_r, BLOCK_V=c.block_v, num_warps=c.num_warps)


def tile_stats(z, y_local, state, first: bool, temperature: float, with_entropy: bool,
               keep_z: bool = False, softcap: float | None = None) -> None:
    """As `tile_ops.tile_stats`; z is only read here whatever `keep_z` says. y_local: targets minus the
    chunk start."""
    n, bv = z.shape
    if n == 0:
        return
    m, s, u, z_y = state
    grid, meta = _launch_args(n)
    _stats_kernel[grid](z, y_local, m, s, u, z_y, n, bv, temperature, 1.0 if softcap is None else softcap,
                        FIRST=first, WITH_ENT=with_entropy, SOFTCAP=softcap is not None, **meta)


def tile_grad(z, y_local, rowstats, g, ge, temperature: float, out: torch.Tensor,
              softcap: float | None = None) -> torch.Tensor:
    """As `tile_ops.tile_grad`: dz [n, bv] written into `out` (its dtype; z itself is fine) from tile z,
    which is only read here."""
    n, bv = z.shape
    if n == 0:
        return out
    m, log_s, ent = rowstats
    grid, meta = _launch_args(n)
    _grad_kernel[grid](z, out, y_local, g, ge if ge is not None else g, m, log_s,
                       ent if ent is not None else m, n, bv, temperature, 1.0 if softcap is None else softcap,
                       HAS_GE=ge is not None, SOFTCAP=softcap is not None, **meta)
    return out

"""Triton path: fused LM head -> per-token log-prob / entropy, forward and backward, no `[N, V]` logits.

Layout (as Liger / Apple CCE): forward kernel + merge, backward kernels, launch configs and launchers,
`autograd.Function`, public function. The math is KERNELS.md's; z = h W^T / T, fp32 accumulation.

Forward. Programs own (token block x vocab split). Each streams its split tile by tile, keeping an
online (m, s = sum exp(z - m), u = sum exp(z - m)(z - m)) per row and picking z_y in the same pass;
columns past V are -inf and never enter m, s or u (V prime, all-negative logits). A merge kernel
combines the splits in a fixed order and keeps M and log S (not their rounded sum lse, whose error
eps |M| would distort p at T = 0.05): logp = (z_y - M) - log S <= 0,
entropy = log S - U / S >= 0. The split count depends on V only, so a row's log-prob does not depend
on N or on the other rows.

Backward. dz = g (onehot - p) + gH p (E_p z - z), pre-scaled by 1/T through g and gH. Only rows with
g != 0 or gH != 0 are worked on: torch compacts their indices first (one host sync) and the kernels
gather those rows, so masked, prompt and clipped tokens cost nothing. The kernels form the dense
part p (gH (-H - log p) - g) of dz; the one-hot part g is added exactly in fp32 outside the tensor-core
dots (dh: a gather of W[y]; dW: `_onehot_dw_kernel`), so 16-bit dots round only the small p terms.
- deterministic (default): dh by programs owning (active token block x vocab split), writing per-split
  partials summed in a fixed order; dW by programs owning a vocab block and looping over all active
  token blocks in order. The logits are recomputed in both: 10 NHV FLOPs in all instead of 8.
- atomics (opt-in: `deterministic=False` or FLASHDAPO_DETERMINISTIC=0): one kernel per (token block x
  vocab block) recomputes once and atomically adds into fp32 dh and dW: 8 NHV, run-to-run bits vary.

Launch configs are hand-picked per shape class (`_config`); FLASHDAPO_AUTOTUNE=1 turns on a small
search instead. On CPU the kernels run under TRITON_INTERPRET=1 (set it before triton is imported),
which has no bf16 tensor-core dot: there the 16-bit tiles are upcast after the same rounding.
All pointer offsets are int64. Targets of rows with a nonzero upstream gradient must lie in [0, V):
backward checks them (ValueError) before any kernel reads W[y] or writes dW[y]; rows with zero
gradient may carry any target (e.g. an ignore index of -100), the forward then leaves a meaningless
log-prob for them but reads and writes nothing out of bounds.
Kernel launches run under `torch.cuda.device(h.device)`, so tensors on a non-current GPU work.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
AUTOTUNE = os.environ.get("FLASHDAPO_AUTOTUNE", "0") == "1"


# ------------------------------------------------------------------------------ shared tile helpers
@triton.jit
def _logit_tile(h_ptr, w_ptr, h_off, row_mask, cols, col_mask, H, temperature,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """z = h W^T / T for one [BLOCK_N, BLOCK_V] tile: reads (BN + BV) * H elements, 2 BN BV H FLOPs."""
    w_off = cols.to(tl.int64) * H
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < H
        h = tl.load(h_ptr + h_off[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + w_off[:, None] + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    return acc / temperature


@triton.jit
def _dense_dz(z, m, log_s, g, ge, ent, mask, HAS_GE: tl.constexpr):
    """Dense part of dz (no one-hot): p (gH (-entropy - log p) - g); 0 outside `mask`."""
    t = (z - m[:, None]) - log_s[:, None]
    coef = -g[:, None]
    if HAS_GE:
        coef = ge[:, None] * (-ent[:, None] - t) + coef
    return tl.where(mask, tl.exp(t) * coef, 0.0)


@triton.jit
def _to_dot(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """Round to the tensor-core input dtype (under the interpreter: round, then back to fp32)."""
    x = x.to(dtype)
    if UPCAST:
        x = x.to(tl.float32)
    return x


# ------------------------------------------------------------------------------ forward
@triton.jit
def _fwd_kernel(h_ptr, w_ptr, y_ptr, part_ptr, N, V, H, temperature, num_splits,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                WITH_ENT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One (token block, vocab split): online max / sum-exp / sum p*z and z_y over the split's tiles.

    Moves BN*H*(V/S/BV) + (V/S)*H input elements (h tile re-read per vocab tile from L2), computes
    2*BN*(V/S)*H FLOPs, writes 4 floats per row: partials [S, 4, N] = (m, s, u, z_y).
    """
    pid_s, pid_n = tl.program_id(0), tl.program_id(1)  # split fastest: concurrent programs share h blocks
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows64 = rows.to(tl.int64)
    y = tl.load(y_ptr + rows64, mask=row_mask, other=-1).to(tl.int32)  # V < 2^31: int32 compares
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    u = tl.zeros((BLOCK_N,), tl.float32)
    z_y = tl.zeros((BLOCK_N,), tl.float32)
    tiles_per_split = tl.cdiv(tl.cdiv(V, BLOCK_V), num_splits)
    v_begin = pid_s * tiles_per_split * BLOCK_V
    n_tiles = tl.minimum(tiles_per_split, tl.cdiv(V - v_begin, BLOCK_V))  # <= 0 for an empty split
    for t in range(0, n_tiles):
        cols = v_begin + t * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        z = _logit_tile(h_ptr, w_ptr, rows64 * H, row_mask, cols, col_mask, H, temperature,
                        BLOCK_N, BLOCK_V, BLOCK_H, UPCAST, PRECISION)
        # Padded columns never enter max or sum (V prime, all-negative logits: verl #2899, PR #7439).
        m_new = tl.maximum(m, tl.max(tl.where(col_mask[None, :], z, float("-inf")), axis=1))  # finite
        alpha = tl.exp(m - m_new)  # 0 on the first tile (m = -inf)
        zs = tl.where(col_mask[None, :], z - m_new[:, None], 0.0)
        e = tl.where(col_mask[None, :], tl.exp(zs), 0.0)
        if WITH_ENT:
            shift = (tl.where(s > 0, m, m_new) - m_new) * s  # not -inf * 0 on the first tile
            u = alpha * (u + shift) + tl.sum(e * zs, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        z_y += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)  # exact: one term, rest 0
        m = m_new
    base = pid_s.to(tl.int64) * 4
    tl.store(part_ptr + base * N + rows64, m, mask=row_mask)
    tl.store(part_ptr + (base + 1) * N + rows64, s, mask=row_mask)
    tl.store(part_ptr + (base + 2) * N + rows64, u, mask=row_mask)
    tl.store(part_ptr + (base + 3) * N + rows64, z_y, mask=row_mask)


@triton.jit
def _merge_kernel(part_ptr, logp_ptr, m_ptr, log_s_ptr, ent_ptr, N, num_splits,
                  BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, WITH_ENT: tl.constexpr):
    """Merge the S split partials of BLOCK_N rows in a fixed order: reads 16 S, writes 16 bytes a row."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    sp = tl.arange(0, SPLITS)
    mask = (sp[:, None] < num_splits) & row_mask[None, :]
    base = sp[:, None].to(tl.int64) * 4
    rows64 = rows[None, :].to(tl.int64)
    m = tl.load(part_ptr + base * N + rows64, mask=mask, other=float("-inf"))
    s = tl.load(part_ptr + (base + 1) * N + rows64, mask=mask, other=0.0)
    valid = mask & (s > 0)  # an empty split (or a padded row) carries nothing
    m_max = tl.max(tl.where(valid, m, float("-inf")), axis=0)
    m_max = tl.where(row_mask, m_max, 0.0)
    m = tl.where(valid, m, m_max[None, :])  # invalid entries: a = 0 below, and no -inf arithmetic
    a = tl.where(valid, tl.exp(m - m_max[None, :]), 0.0)
    s_tot = tl.sum(a * s, axis=0)
    log_s = tl.log(tl.where(row_mask, s_tot, 1.0))
    z_y = tl.sum(tl.load(part_ptr + (base + 3) * N + rows64, mask=mask, other=0.0), axis=0)
    tl.store(logp_ptr + rows, (z_y - m_max) - log_s, mask=row_mask)
    tl.store(m_ptr + rows, m_max, mask=row_mask)
    tl.store(log_s_ptr + rows, log_s, mask=row_mask)
    if WITH_ENT:
        u = tl.load(part_ptr + (base + 2) * N + rows64, mask=mask, other=0.0)
        u_tot = tl.sum(tl.where(valid, a * (u + (m - m_max[None, :]) * s), 0.0), axis=0)
        tl.store(ent_ptr + rows, log_s - u_tot / tl.where(row_mask, s_tot, 1.0), mask=row_mask)


# ------------------------------------------------------------------------------ backward
@triton.jit
def _row_stats(rows_ptr, g_ptr, ge_ptr, stat_ptr, N, idx, act_mask, HAS_GE: tl.constexpr):
    """Gather the compacted rows' index, g, gH, m, log s, entropy (g = gH = 0 on padding).

    stat_ptr is [3, N] fp32: (m, log s, entropy), as the forward left them."""
    rows = tl.load(rows_ptr + idx, mask=act_mask, other=0)
    g = tl.load(g_ptr + rows, mask=act_mask, other=0.0)
    m = tl.load(stat_ptr + rows, mask=act_mask, other=0.0)
    log_s = tl.load(stat_ptr + N + rows, mask=act_mask, other=0.0)
    ge = g
    ent = m
    if HAS_GE:
        ge = tl.load(ge_ptr + rows, mask=act_mask, other=0.0)
        ent = tl.load(stat_ptr + 2 * N + rows, mask=act_mask, other=0.0)
    return rows, g, ge, m, log_s, ent


@triton.jit
def _bwd_dh_kernel(h_ptr, w_ptr, rows_ptr, g_ptr, ge_ptr, stat_ptr, ws_ptr,
                   N, n_act, V, H, temperature, num_splits,
                   BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                   HAS_GE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Deterministic dh: one (active token block, vocab split) owns ws[split, block, :] (fp32).

    Per vocab tile: recompute z (2 BN BV H FLOPs), form dz, then ws += dz W_tile (2 BN BV H FLOPs),
    read-modify-writing the block's BN x H fp32 partial (8 BN H bytes, L2-resident) once per tile.
    """
    pid_s, pid_n = tl.program_id(0), tl.program_id(1)  # split fastest: concurrent programs share h blocks
    idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    act_mask = idx < n_act
    rows, g, ge, m, log_s, ent = _row_stats(rows_ptr, g_ptr, ge_ptr, stat_ptr, N, idx, act_mask, HAS_GE)
    ws_off = (pid_s.to(tl.int64) * n_act + idx.to(tl.int64)) * H
    tiles_per_split = tl.cdiv(tl.cdiv(V, BLOCK_V), num_splits)
    v_begin = pid_s * tiles_per_split * BLOCK_V
    n_tiles = tl.minimum(tiles_per_split, tl.cdiv(V - v_begin, BLOCK_V))
    for t in range(0, n_tiles):
        cols = v_begin + t * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        z = _logit_tile(h_ptr, w_ptr, rows * H, act_mask, cols, col_mask, H, temperature,
                        BLOCK_N, BLOCK_V, BLOCK_H, UPCAST, PRECISION)
        dz = _dense_dz(z, m, log_s, g, ge, ent, act_mask[:, None] & col_mask[None, :], HAS_GE)
        dz = _to_dot(dz, w_ptr.dtype.element_ty, UPCAST)
        w_off = cols.to(tl.int64) * H
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_mask = ks < H
            w = tl.load(w_ptr + w_off[:, None] + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            ptrs = ws_ptr + ws_off[:, None] + ks[None, :]
            st_mask = act_mask[:, None] & k_mask[None, :]
            acc = tl.dot(dz, w, tl.load(ptrs, mask=st_mask, other=0.0), input_precision=PRECISION)
            tl.store(ptrs, acc, mask=st_mask)


@triton.jit
def _bwd_dw_kernel(h_ptr, w_ptr, rows_ptr, g_ptr, ge_ptr, stat_ptr, dw_ptr,
                   N, n_act, V, H, temperature,
                   BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                   HAS_GE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Deterministic dW: one vocab block owns dW[block, :] (fp32) and walks the active tokens in order.

    Per token block: recompute z (2 BN BV H FLOPs), dz, then dW_tile += dz^T h (2 BN BV H FLOPs),
    read-modify-writing the BV x H fp32 tile (8 BV H bytes, L2-resident) once per token block.
    """
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    dw_off = cols.to(tl.int64) * H
    for n0 in range(0, n_act, BLOCK_N):
        idx = n0 + tl.arange(0, BLOCK_N)
        act_mask = idx < n_act
        rows, g, ge, m, log_s, ent = _row_stats(rows_ptr, g_ptr, ge_ptr, stat_ptr, N, idx, act_mask, HAS_GE)
        z = _logit_tile(h_ptr, w_ptr, rows * H, act_mask, cols, col_mask, H, temperature,
                        BLOCK_N, BLOCK_V, BLOCK_H, UPCAST, PRECISION)
        dz = _dense_dz(z, m, log_s, g, ge, ent, act_mask[:, None] & col_mask[None, :], HAS_GE)
        dz_t = tl.trans(_to_dot(dz, h_ptr.dtype.element_ty, UPCAST))
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_mask = ks < H
            h = tl.load(h_ptr + rows[:, None] * H + ks[None, :], mask=act_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:
                h = h.to(tl.float32)
            ptrs = dw_ptr + dw_off[:, None] + ks[None, :]
            st_mask = col_mask[:, None] & k_mask[None, :]
            acc = tl.dot(dz_t, h, tl.load(ptrs, mask=st_mask, other=0.0), input_precision=PRECISION)
            tl.store(ptrs, acc, mask=st_mask)


@triton.jit
def _bwd_atomic_kernel(h_ptr, w_ptr, rows_ptr, g_ptr, ge_ptr, stat_ptr, dh_ptr, dw_ptr,
                       N, n_act, V, H, temperature,
                       BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                       HAS_GE: tl.constexpr, NEED_H: tl.constexpr, NEED_W: tl.constexpr,
                       UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Opt-in, nondeterministic: one (token block, vocab block) recomputes z once (6 BN BV H FLOPs in
    all) and atomically adds dz W into dh[block] and dz^T h into dW[block] (fp32)."""
    idx = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    act_mask = idx < n_act
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    rows, g, ge, m, log_s, ent = _row_stats(rows_ptr, g_ptr, ge_ptr, stat_ptr, N, idx, act_mask, HAS_GE)
    z = _logit_tile(h_ptr, w_ptr, rows * H, act_mask, cols, col_mask, H, temperature,
                    BLOCK_N, BLOCK_V, BLOCK_H, UPCAST, PRECISION)
    dz = _to_dot(_dense_dz(z, m, log_s, g, ge, ent, act_mask[:, None] & col_mask[None, :], HAS_GE),
                 h_ptr.dtype.element_ty, UPCAST)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < H
        if NEED_H:
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * H + ks[None, :],
                        mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            tl.atomic_add(dh_ptr + idx.to(tl.int64)[:, None] * H + ks[None, :],
                          tl.dot(dz, w, input_precision=PRECISION), mask=act_mask[:, None] & k_mask[None, :])
        if NEED_W:
            h = tl.load(h_ptr + rows[:, None] * H + ks[None, :], mask=act_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:
                h = h.to(tl.float32)
            tl.atomic_add(dw_ptr + cols.to(tl.int64)[:, None] * H + ks[None, :],
                          tl.dot(tl.trans(dz), h, input_precision=PRECISION),
                          mask=col_mask[:, None] & k_mask[None, :])


@triton.jit
def _onehot_dw_kernel(h_ptr, g_ptr, rows_sorted_ptr, seg_ptr, y_sorted_ptr, dw_ptr, H, BLOCK_H: tl.constexpr):
    """The one-hot part of dW in exact fp32: one program per distinct target y adds sum g_i h_i over
    its rows (sorted by target, stable) in order: reads H elements per active row, deterministic."""
    pid = tl.program_id(0)
    start = tl.load(seg_ptr + pid)
    end = tl.load(seg_ptr + pid + 1)
    y = tl.load(y_sorted_ptr + start).to(tl.int64)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < H
        acc = tl.load(dw_ptr + y * H + ks, mask=k_mask, other=0.0)
        for j in range(start, end):
            r = tl.load(rows_sorted_ptr + j)
            acc += tl.load(g_ptr + r) * tl.load(h_ptr + r * H + ks, mask=k_mask, other=0.0).to(tl.float32)
        tl.store(dw_ptr + y * H + ks, acc, mask=k_mask)


# ------------------------------------------------------------------------------ launch configs
@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of one kernel for one shape class."""

    block_n: int
    block_v: int
    block_h: int
    num_warps: int = 4
    num_stages: int = 2


def _config(kernel: str, dtype: torch.dtype, hdim: int) -> LaunchConfig:
    """One hand-picked config per shape class: (interpreter | CUDA 16-bit | CUDA fp32) x small H.

    CUDA picks are first guesses for Hopper (H200/H20: 228 KB shared memory per SM), not yet measured:
    fwd/dh/dw 16-bit use 128x128 logit tiles (64 KB fp32 accumulator over 8 warps) with 64-wide H steps
    and 3 stages (2 x 16 KB bf16 tiles per stage); fp32 halves the tiles. bench/gpu_check.sh times them.
    """
    if INTERPRET:  # tl.dot wants every dim >= 16; tiny tiles keep the interpreter's work small
        return LaunchConfig(16, 32, 16, 1, 1)
    block_h = 64 if hdim >= 64 else 32
    if dtype == torch.float32:
        return LaunchConfig(64, 64, min(block_h, 32), 4, 2)
    if kernel == "dw":  # owns a vocab block; walks token blocks of 64 to halve dz^T's registers
        return LaunchConfig(64, 128, block_h, 8, 3)
    if kernel == "atomic":
        return LaunchConfig(64, 128, block_h, 8, 2)
    return LaunchConfig(128, 128, block_h, 8, 3)


def _autotune_configs(reset: list[str] | None = None):
    """The search space FLASHDAPO_AUTOTUNE=1 opens (a handful of tile shapes; keyed on V and H)."""
    shapes = [(128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (64, 64, 32, 4, 2)]
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_V": v, "BLOCK_H": h}, num_warps=w, num_stages=st)
               for n, v, h, w, st in shapes]
    return dict(configs=configs, key=["V", "H"], reset_to_zero=reset)


if AUTOTUNE and not INTERPRET:
    _fwd_kernel = triton.autotune(**_autotune_configs())(_fwd_kernel)
    _bwd_dh_kernel = triton.autotune(**_autotune_configs(["ws_ptr"]))(_bwd_dh_kernel)
    _bwd_dw_kernel = triton.autotune(**_autotune_configs(["dw_ptr"]))(_bwd_dw_kernel)
    _bwd_atomic_kernel = triton.autotune(**_autotune_configs(["dh_ptr", "dw_ptr"]))(_bwd_atomic_kernel)


def _meta(kernel: str, dtype: torch.dtype, hdim: int) -> dict:
    """Launch keywords: the hand-picked config, or nothing when the autotuner chooses."""
    if AUTOTUNE and not INTERPRET:
        return {}
    c = _config(kernel, dtype, hdim)
    return dict(BLOCK_N=c.block_n, BLOCK_V=c.block_v, BLOCK_H=c.block_h, num_warps=c.num_warps,
                num_stages=c.num_stages)


def _dot_flags(dtype: torch.dtype) -> dict:
    # fp32 inputs: true fp32 dots ("ieee"), as naive torch; 16-bit: tensor cores, fp32 accumulation.
    # "tf32x3" compiles without the register spills "ieee" has on sm_90 (bench/results/NOTES.md), but the
    # interpreter ignores input_precision, so its accuracy is unverified here: kept "ieee".
    return dict(UPCAST=INTERPRET and dtype != torch.float32, PRECISION="ieee" if dtype == torch.float32 else "tf32")


def _num_sms(device: torch.device) -> int:
    return 4 if device.type != "cuda" else torch.cuda.get_device_properties(device).multi_processor_count


# ------------------------------------------------------------------------------ launchers
def _forward(h, w, y, temperature, with_entropy):
    """logp [N] and stats [3, N] = (m, log s, entropy), fp32; the split count depends on V only."""
    n, hdim = h.shape
    vocab = w.shape[0]
    split_cols = 64 if INTERPRET else 8192
    splits = max(1, min(64, triton.cdiv(vocab, split_cols)))
    logp = torch.empty(n, dtype=torch.float32, device=h.device)
    stats = torch.empty((3, n), dtype=torch.float32, device=h.device)
    if n == 0:  # an empty micro-batch: nothing to launch
        return logp, stats
    part = torch.empty((splits, 4, n), dtype=torch.float32, device=h.device)
    meta = _meta("fwd", h.dtype, hdim)
    grid = lambda m: (splits, triton.cdiv(n, m["BLOCK_N"]))
    _fwd_kernel[grid](h, w, y, part, n, vocab, hdim, temperature, splits,
                      WITH_ENT=with_entropy, **_dot_flags(h.dtype), **meta)
    block = 16 if INTERPRET else 128
    _merge_kernel[(triton.cdiv(n, block),)](part, logp, stats[0], stats[1], stats[2], n, splits, BLOCK_N=block,
                                            SPLITS=max(2, triton.next_power_of_2(splits)), WITH_ENT=with_entropy)
    return logp, stats


def _onehot_dw(h, g_s, rows, y_act, dw):
    """dW[y_i] += g_i h_i for the active rows (targets y_act = y[rows]), exact fp32, deterministic."""
    order = torch.argsort(y_act, stable=True)
    y_sorted, rows_sorted = y_act[order].contiguous(), rows[order].contiguous()
    counts = torch.unique_consecutive(y_sorted, return_counts=True)[1]
    seg = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=h.device)
    seg[1:] = counts.cumsum(0)
    _onehot_dw_kernel[(counts.numel(),)](h, g_s, rows_sorted, seg, y_sorted, dw, h.shape[1],
                                         BLOCK_H=16 if INTERPRET else 128)


def _check_targets(y_act: torch.Tensor, vocab: int) -> None:
    """Raise ValueError if an active row's target lies outside [0, V) (W[y] / dW[y] would be out of bounds)."""
    if y_act.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(y_act)).tolist())  # one host sync
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"target {bad} of a row with nonzero gradient is outside [0, V={vocab}); "
                         "give ignored rows (e.g. target -100) a zero upstream gradient")


def _backward(h, w, y, stats, grad_logp, grad_ent, temperature, need_h, need_w, deterministic, dh_dtype=None):
    """dh (dh_dtype, default h's) and dW (fp32) over the rows whose upstream gradients are not both zero."""
    n, hdim = h.shape
    vocab = w.shape[0]
    active = torch.zeros(n, dtype=torch.bool, device=h.device)
    for grad in (grad_logp, grad_ent):
        if grad is not None:
            active |= grad != 0
    rows = torch.nonzero(active).squeeze(1)  # one host sync: sizes the grids to the live rows
    n_act = rows.numel()
    y_act = y[rows]
    _check_targets(y_act, vocab)
    dw = torch.zeros((vocab, hdim), dtype=torch.float32, device=h.device) if need_w else None
    if n_act == 0 or not (need_h or need_w):
        return (torch.zeros_like(h, dtype=dh_dtype) if need_h else None), dw
    # 1/T folded into the per-row upstream gradients: dz/T costs N multiplies instead of N V.
    g_s = (grad_logp.float() / temperature) if grad_logp is not None else torch.zeros_like(stats[0])
    has_ge = grad_ent is not None
    ge_s = grad_ent.float() / temperature if has_ge else g_s
    args = (h, w, rows, g_s.contiguous(), ge_s.contiguous(), stats)
    flags = dict(HAS_GE=has_ge, **_dot_flags(h.dtype))
    dh, dh_act = None, None
    if deterministic:
        if need_h:
            meta = _meta("dh", h.dtype, hdim)
            blocks = triton.cdiv(n_act, meta.get("BLOCK_N", 64))
            splits = 2 if INTERPRET else max(1, min(8, triton.cdiv(2 * _num_sms(h.device), blocks)))
            ws = torch.zeros((splits, n_act, hdim), dtype=torch.float32, device=h.device)
            grid = lambda m: (splits, triton.cdiv(n_act, m["BLOCK_N"]))
            _bwd_dh_kernel[grid](*args, ws, n, n_act, vocab, hdim, temperature, splits, **flags, **meta)
            dh_act = ws.sum(0) if splits > 1 else ws[0]  # fixed-order reduction of the split partials
            del ws  # free the split workspace before dW's kernel runs
        if need_w:
            grid = lambda m: (triton.cdiv(vocab, m["BLOCK_V"]),)
            _bwd_dw_kernel[grid](*args, dw, n, n_act, vocab, hdim, temperature, **flags,
                                 **_meta("dw", h.dtype, hdim))
    else:
        dh_act = torch.zeros((n_act, hdim), dtype=torch.float32, device=h.device) if need_h else None
        grid = lambda m: (triton.cdiv(n_act, m["BLOCK_N"]), triton.cdiv(vocab, m["BLOCK_V"]))
        _bwd_atomic_kernel[grid](*args, dh_act if need_h else dw, dw if need_w else dh_act, n, n_act, vocab, hdim,
                                 temperature, NEED_H=need_h, NEED_W=need_w, **flags,
                                 **_meta("atomic", h.dtype, hdim))
    if need_h:
        # One-hot part, exact fp32, in place: W[y] is upcast inside addcmul_ (no fp32 [n_act, H] copy).
        dh_act.addcmul_(g_s[rows].unsqueeze(1), w[y_act])
        out_dtype = h.dtype if dh_dtype is None else dh_dtype
        if n_act == n:
            dh = dh_act.to(out_dtype)
        else:
            dh = torch.zeros_like(h, dtype=out_dtype)
            dh[rows] = dh_act.to(out_dtype)
    if need_w:
        _onehot_dw(h, g_s, rows, y_act, dw)
    return dh, dw


# ------------------------------------------------------------------------------ autograd + public API
_HALF = (torch.bfloat16, torch.float16)


def _compute_dtype(h_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """One compute dtype for both operands (tl.dot needs it), as autocast would pick it: a 16-bit operand
    wins over an fp32/fp64 one (which is cast down); equal dtypes stay; fp64 (test-only) and a bf16/fp16
    mix compute in fp32."""
    if h_dtype == w_dtype:
        return torch.float32 if h_dtype == torch.float64 else h_dtype
    if (h_dtype in _HALF) != (w_dtype in _HALF):
        return h_dtype if h_dtype in _HALF else w_dtype
    return torch.float32


def _on_device(t: torch.Tensor):
    """Launch on t's GPU (Triton launches on the current device); a no-op on CPU / the interpreter."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else nullcontext()


class _TritonLogprobs(torch.autograd.Function):
    """(logp, entropy) from the fused kernels; saves h, W, targets and 8 bytes per token."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, deterministic):
        # An output whose gradient is not needed (the entropy, in the DAPO loss) reaches backward as None,
        # not as zeros: its term is then skipped instead of computed on zeros.
        ctx.set_materialize_grads(False)
        dtype = _compute_dtype(hidden.dtype, weight.dtype)
        h, w = hidden.to(dtype).contiguous(), weight.to(dtype).contiguous()
        y = targets.contiguous()
        with _on_device(h):
            logp, stats = _forward(h, w, y, temperature, with_entropy)
        ctx.save_for_backward(h, w, y, stats)
        ctx.temperature, ctx.deterministic = temperature, deterministic
        ctx.in_dtypes = (hidden.dtype, weight.dtype)
        return logp, (stats[2].clone() if with_entropy else None)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        h, w, y, stats = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with _on_device(h):
            dh, dw = _backward(h, w, y, stats, grad_logp, grad_ent, ctx.temperature, need_h, need_w,
                               ctx.deterministic, dh_dtype=ctx.in_dtypes[0] if need_h else None)
        dh = dh.to(ctx.in_dtypes[0]) if dh is not None else None
        dw = dw.to(ctx.in_dtypes[1]) if dw is not None else None
        return dh, dw, None, None, None, None


def triton_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    deterministic: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) [N] fp32 and optionally entropy [N] fp32, by the fused Triton kernels.

    hidden [N, H], weight [V, H] (bf16/fp16/fp32), targets [N] in [0, V) on every row with a nonzero
    upstream gradient (else backward raises ValueError). Mixed dtypes compute as autocast would: the fp32
    operand is cast to the other's 16-bit dtype (tensor-core dots, no fp32 copy of W); gradients come back
    in each input's dtype, dh rounded once from fp32. Pure fp32 stays fp32. Differentiable in hidden and
    weight through both outputs. `deterministic` (default: FLASHDAPO_DETERMINISTIC, default on) selects
    the bitwise-reproducible backward; False the atomic one (not yet benchmarked faster). Needs CUDA tensors, or CPU
    tensors with TRITON_INTERPRET=1 set before triton was first imported.
    """
    if hidden.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before importing triton "
                           "(CPU, small shapes only); use impl='torch' on CPU")
    if deterministic is None:
        deterministic = os.environ.get("FLASHDAPO_DETERMINISTIC", "1") != "0"
    return _TritonLogprobs.apply(hidden, weight, targets, float(temperature), bool(with_entropy), bool(deterministic))

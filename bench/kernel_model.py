"""Analytic cost of each log-prob provider on a GPU: matmul FLOPs, HBM bytes, peak extra memory, time.

One forward + backward step into h and W, every row live (`-50%`: half the rows at zero gradient),
16-bit inputs (2 bytes) unless the design computes in fp32. Counts follow the chunk plan of
flashdapo.kernels.chunked (vocabulary chunks of CUDA_CHUNK_VOCAB columns, token chunks filling
CUDA_TILE_ELEMS); docs/kernels.md derives them. Time = matmul FLOPs at the matmul rate + the other
HBM bytes at the copy rate (the elementwise passes are separate kernels, so the two add).

Reference machine (H200): ~790 TFLOP/s dense bf16 matmul on random data and ~4.3 TB/s device copy;
assumed sustained here: 700 TFLOP/s for cuBLAS at these shapes (M, N, K >= 4096), 3.4 TB/s for
streaming kernels, 60 TFLOP/s for fp32 matmuls without TF32 (what naive torch runs in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashdapo.kernels.chunked import plan_chunks

BF16_TFLOPS, FP32_TFLOPS, HBM_TBPS = 700.0, 60.0, 3.4
SHAPES = {"0.5B": (8192, 896, 151936), "7B": (16384, 3584, 152064), "32B": (32768, 5120, 152064)}


@dataclass(frozen=True)
class Cost:
    """What one step of a design moves and computes."""

    matmul_tflop: float
    hbm_gb: float
    peak_extra_gb: float
    tflops_rate: float

    @property
    def ms(self) -> float:
        return self.matmul_tflop / self.tflops_rate * 1e3 + self.hbm_gb / HBM_TBPS


def _naive(n, h, v) -> Cost:
    """fp32 logits: matmul, /T, log_softmax (2 reads), gather; backward: scatter, log_softmax backward,
    /T backward, two matmuls reading the logit gradient: ~14 passes of 4 N V bytes."""
    nv = n * v
    return Cost(6 * n * h * v / 1e12, 14 * 4 * nv / 1e9, (3 * 4 * nv + 8 * v * h + 6 * n * h) / 1e9, FP32_TFLOPS)


def _chunked(n, h, v, live: float = 1.0, bytes_per: int = 2) -> Cost:
    """The generic driver: forward z write + stats read (8 N V); backward on live rows: z write + read,
    dz write + two reads (8 + 3 x bytes_per per element), dh accumulation per vocabulary chunk, dW slab
    per chunk, W and h re-read per tile row/column."""
    plan = plan_chunks(n, v, "cuda")
    bn, bv = plan.chunk_tokens, plan.chunk_vocab
    na = int(n * live)
    v_chunks, t_chunks = -(-v // bv), -(-na // bn)
    elementwise = 8 * n * v + (8 + 3 * bytes_per) * na * v
    dh_acc = v_chunks * 16 * na * h  # mm result write + read, accumulator read + write (fp32)
    dw_slab = t_chunks * 16 * v * h + 2 * v * h
    operands = bytes_per * ((-(-n // bn) + 2 * t_chunks) * v * h + 3 * v_chunks * n * h)
    tile = bn * bv * (4 + bytes_per) + 4 * (bn + bv) * h
    peak = tile + 4 * bv * h + (4 + bytes_per) * na * h + bytes_per * v * h
    rate = BF16_TFLOPS if bytes_per == 2 else FP32_TFLOPS
    return Cost((2 + 6 * live) * n * h * v / 1e12, (elementwise + dh_acc + dw_slab + operands) / 1e9, peak / 1e9,
                rate)


def _fused(n, h, v, bytes_per: int = 2) -> Cost:
    """The fused sweep: per token chunk the [C, V] fp32 tiles are written once, read by the stats and the
    gradient pass; dz written once, read by two matmuls; the fp32 dW accumulator is read and written
    (and the matmul's fp32 result written and read) once per token chunk."""
    plan = plan_chunks(n, v, "cuda")
    c = plan.chunk_tokens
    t_chunks = -(-n // c)
    elementwise = (12 + 3 * bytes_per) * n * v
    dw_acc = t_chunks * 16 * v * h + 2 * v * h
    operands = bytes_per * (3 * t_chunks * v * h + 3 * n * h)
    peak = c * v * (4 + bytes_per) + 8 * v * h + bytes_per * v * h + 4 * c * h + (4 + bytes_per) * n * h
    rate = BF16_TFLOPS if bytes_per == 2 else FP32_TFLOPS
    return Cost(6 * n * h * v / 1e12, (elementwise + dw_acc + operands) / 1e9, peak / 1e9, rate)


def predict(provider: str, shape: str) -> Cost | None:
    """The modelled cost of `provider` at a named shape (bf16 inputs), or None when not modelled."""
    n, h, v = SHAPES[shape]
    if provider == "naive":
        return _naive(n, h, v)
    if provider == "torch":  # the torch impl computes in fp32 on any device
        return _chunked(n, h, v, bytes_per=4)
    if provider == "torch-50%":
        return _chunked(n, h, v, live=0.5, bytes_per=4)
    if provider == "torch-fused":
        return _fused(n, h, v, bytes_per=4)
    if provider == "triton":
        return _chunked(n, h, v)
    if provider == "triton-50%":
        return _chunked(n, h, v, live=0.5)
    if provider == "triton-fused":
        return _fused(n, h, v)
    return None

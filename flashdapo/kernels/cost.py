"""Analytic cost of each LM-head design on a GPU, from exposed bytes: GEMM time + separate kernels' bytes.

One forward + backward step into h and W, every row live (`live` < 1: that share of the rows has a non-zero
gradient), bf16 inputs. Time = each GEMM at the GEMM rate (its own operand and output traffic is hidden
inside it: every GEMM here is compute-bound, arithmetic intensity >= bv/4 = 1024 FLOP/byte against ridges
of 37 (H20) to 300 (H100) FLOP/byte) + only the bytes that SEPARATE kernels move (the elementwise passes
over the fp32 logit tiles, casts, zero fills) at the streaming rate. Peak extra memory is the maximum over
the phases of a step (forward, backward loop, end of backward), gradients included; workspace = peak minus
the gradient outputs (dh, dW in the inputs' dtype). The formulas are written out in docs/kernels.md ("Cost
model"); the chunk sizes are the drivers' own (chunked.plan_chunks, fused.fused_chunk_tokens).

`Rates()` are an H200's (GEMM 740 TFLOP/s: an assumption of 94% of the ~790 measured on a random 8192^3
bf16 matmul; 3.4 TB/s streaming, 80% of the ~4.3 TB/s copy rate; fp32 GEMMs without TF32 60 TFLOP/s);
`Rates.scaled` carries the same fractions to another GPU's datasheet figures (flashdapo/kernels/gpus.py).
Used by `bench/kernel_model.py`, `flashdapo plan` and the trainer's choice of design (`lm_head_choice.py`).

The elementwise passes also carry transcendental work (exp, reciprocals: the SFU, 1/16 of the fp32 FLOP
rate): each pass takes the longer of its bytes and its SFU ops. Without a softcap every pass streams (2
ops a logit against >= 4 bytes), so the SFU term is exactly 0; a final-logit softcap (`softcap=True`)
doubles the ops (tanh and sech^2 per logit, bytes unchanged), which the stats pass's 4 bytes a logit cover
on an H200 (3.75 T ops/s against 3.4 TB/s) but not on an H20 (2.5 T ops/s against 2.8 TB/s).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .chunked import plan_chunks
from .fused import TILE_VOCAB, fused_chunk_tokens


@dataclass(frozen=True)
class Rates:
    """Sustained rates the model assumes (see the module docstring)."""

    gemm_tflops: float = 740.0
    hbm_tbps: float = 3.4
    fp32_tflops: float = 60.0
    ceiling_tflops: float = 790.0  # the measured bf16 matmul ceiling: the 8NHV reference time

    @property
    def sfu_tops(self) -> float:
        """Transcendental ops per second (exp, reciprocal: the SFU, 16 per SM per clock on Hopper and Ampere
        against 128 fp32 FMA lanes, i.e. 1/16 of the fp32 FLOP rate)."""
        return self.fp32_tflops / 16

    @classmethod
    def scaled(cls, bf16_tflops: float, hbm_tbps: float, fp32_tflops: float) -> Rates:
        """An H200's sustained fractions of its datasheet peaks (989 TFLOP/s bf16 dense, 4.8 TB/s, 67 TFLOP/s
        fp32) applied to another GPU's datasheet figures."""
        h200 = cls()
        return cls(gemm_tflops=h200.gemm_tflops * bf16_tflops / 989.0,
                   hbm_tbps=h200.hbm_tbps * hbm_tbps / 4.8, fp32_tflops=h200.fp32_tflops * fp32_tflops / 67.0,
                   ceiling_tflops=h200.ceiling_tflops * bf16_tflops / 989.0)


RATES = Rates()
"""H200 rates (see the module docstring)."""
GB = 1e9


@dataclass(frozen=True)
class Cost:
    """One step of a design: GEMM FLOPs (and the rate they run at), exposed bytes, memory; and the
    elementwise passes' transcendental work, each pass as (its GB, its G SFU ops), their GB included in
    exposed_gb. A pass takes the longer of its bytes and its SFU ops (a roofline per pass)."""

    gemm_tflop: float
    exposed_gb: float
    peak_extra_gb: float
    workspace_gb: float
    gemm_tflops: float
    hbm_tbps: float
    sfu_passes: tuple[tuple[float, float], ...] = ()
    sfu_tops: float = float("inf")

    @property
    def sfu_gop(self) -> float:
        """G transcendental ops (exp, reciprocal) of the elementwise passes."""
        return sum(gop for _, gop in self.sfu_passes)

    @property
    def sfu_bound_ms(self) -> float:
        """Time the passes lose where their SFU ops outlast their bytes (0 where every pass streams)."""
        return sum(max(0.0, gop / self.sfu_tops - gb / self.hbm_tbps) for gb, gop in self.sfu_passes)

    @property
    def ms(self) -> float:
        return self.gemm_tflop / self.gemm_tflops * 1e3 + self.exposed_gb / self.hbm_tbps + self.sfu_bound_ms


# Transcendental ops per logit of one Triton pass (stats or grad): the division by T (a reciprocal) and one
# exp; a softcap adds tanh and sech^2 (triton_tiles._tanh_sech2): one exp and one reciprocal more (the
# division by c replaces the one by T). Its ~25 fp32 FLOPs a logit (the polynomial, selects, products) stay
# below both the bytes and the SFU at 16 FLOPs per SFU op. Bytes are unchanged.
SFU_PER_LOGIT, SOFTCAP_SFU_PER_LOGIT = 2, 2


def _sfu_per_logit(softcap: bool) -> int:
    return SFU_PER_LOGIT + (SOFTCAP_SFU_PER_LOGIT if softcap else 0)


def ideal_ms(n: int, h: int, v: int, rates: Rates = RATES) -> float:
    """8 N H V at the measured ceiling: the reference every design is held to."""
    return 8 * n * h * v / (rates.ceiling_tflops * 1e12) * 1e3


def naive(n, h, v, rates: Rates = RATES, softcap: bool = False) -> Cost:
    """fp32 logits: the fp32 GEMMs (6 NHV; operands upcast: 4 (N + V) H read, 2 ... written), then ~14
    passes of 4 N V bytes (log_softmax, its backward, /T, gather/scatter); peak: logits, their log-softmax
    and their gradient at once, plus fp32 copies of W and h and the gradients. A softcap (c tanh(x / c)
    through autograd): /c, tanh, *c and their backward, ~13 passes of 4 N V more, and tanh's output saved."""
    nv = n * v
    exposed = (14 + (13 if softcap else 0)) * 4 * nv + 6 * (n + v) * h
    peak = (3 + (1 if softcap else 0)) * 4 * nv + 8 * v * h + 6 * n * h
    return Cost(6 * n * h * v / 1e12, exposed / GB, peak / GB, (peak - 2 * (v + n) * h) / GB,
                rates.fp32_tflops, rates.hbm_tbps)


def generic(n, h, v, live: float = 1.0, rates: Rates = RATES, dtype_bytes: int = 2, device: str = "cuda",
            softcap: bool = False) -> Cost:
    """The generic driver (token_logprobs, impl="triton"): forward GEMM z (hidden) + stats pass reading z
    (4 N V); backward over the live rows n_a, vocabulary outer: recompute GEMM z (hidden), grad pass
    reading z and writing dz (4 + b) n_a V, dW[chunk] = dz^T h and dh += dz W[chunk] inside the GEMMs
    (hidden); the fp32 dh cast to h's dtype (4 + b) n_a H. Peak: the backward loop's dW + fp32 dh + dz
    buffer + one z tile. SFU: 2 ops a logit per pass, 4 with a softcap (its bytes are unchanged)."""
    plan = plan_chunks(n, v, device, dz_bytes=dtype_bytes)
    na = int(n * live)
    bn, bv = min(na, plan.chunk_tokens), plan.chunk_vocab
    exposed = 4 * n * v + (4 + dtype_bytes) * na * v + (4 + dtype_bytes) * na * h
    loop = dtype_bytes * v * h + 4 * na * h + dtype_bytes * na * bv + 4 * bn * bv
    end = dtype_bytes * v * h + (4 + dtype_bytes) * na * h
    forward = 4 * plan.chunk_tokens * plan.chunk_vocab
    peak = max(loop, end, forward) + 12 * n
    grads = dtype_bytes * (v + n) * h
    ops = _sfu_per_logit(softcap)
    passes = ((4 * n * v / GB, ops * n * v / 1e9), ((4 + dtype_bytes) * na * v / GB, ops * na * v / 1e9))
    return Cost((2 + 6 * live) * n * h * v / 1e12, exposed / GB, peak / GB, (peak - grads) / GB,
                rates.gemm_tflops, rates.hbm_tbps, passes, rates.sfu_tops)


def fused(n, h, v, rates: Rates = RATES, dtype_bytes: int = 2, device: str = "cuda",
          softcap: bool = False) -> Cost:
    """The fused sweep (fused_token_loss, impl="triton"): per token chunk of C rows, GEMM z tiles (hidden)
    kept for the whole vocabulary, stats pass reading them (4 C V), grad pass reading them and writing dz
    (4 + b) C V; dh_t += dz W and the fp32 dW accumulator += dz^T h inside the GEMMs (hidden); then the
    accumulator's zero fill (4 V H) and its cast to W's dtype (4 + b) V H, dh's per-chunk cast
    (4 + b) N H. Peak: the fp32 accumulator + the tile set + the final gradients. SFU: 2 ops a logit per
    pass, 4 with a softcap (the kept tiles are the raw z: bytes unchanged)."""
    c, bv = fused_chunk_tokens(n, v, device), min(TILE_VOCAB, v)
    exposed = (8 + dtype_bytes) * n * v + (8 + dtype_bytes) * v * h + (4 + dtype_bytes) * n * h
    sweep = 4 * v * h + 4 * c * v + dtype_bytes * c * bv + 4 * c * h + dtype_bytes * n * h
    end = (4 + dtype_bytes) * v * h + dtype_bytes * n * h
    peak = max(sweep, end) + 16 * n
    grads = dtype_bytes * (v + n) * h
    ops = _sfu_per_logit(softcap)
    passes = ((4 * n * v / GB, ops * n * v / 1e9), ((4 + dtype_bytes) * n * v / GB, ops * n * v / 1e9))
    return Cost(6 * n * h * v / 1e12, exposed / GB, peak / GB, (peak - grads) / GB, rates.gemm_tflops,
                rates.hbm_tbps, passes, rates.sfu_tops)


def torch_impl(n, h, v, rates: Rates = RATES, softcap: bool = False) -> Cost:
    """impl="torch" on a GPU: the generic plan in fp32 operands (no TF32: the fp32 GEMM rate), its
    elementwise passes as torch ops (~6 passes of 4 N V bytes each way, forward and backward). A softcap
    adds 3 in-place passes to the forward (/c, tanh, *c/T) and 6 to the backward (those, cosh^-2 into a
    second tile, dz * sech^2): 72 N V bytes. Torch's passes stream: no SFU term."""
    base = generic(n, h, v, rates=rates, dtype_bytes=4, softcap=softcap)
    extra = 72 * n * v if softcap else 0
    return replace(base, exposed_gb=(48 * n * v + extra + 8 * n * h) / GB, gemm_tflops=rates.fp32_tflops,
                   sfu_passes=())


__all__ = [
    "GB", "RATES", "SFU_PER_LOGIT", "SOFTCAP_SFU_PER_LOGIT", "Cost", "Rates", "fused", "generic", "ideal_ms",
    "naive", "torch_impl"
]

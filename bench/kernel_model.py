"""Analytic cost of each log-prob provider on a GPU, from exposed bytes: GEMM time + separate kernels' bytes.

One forward + backward step into h and W, every row live (`-50%`: half the rows at zero gradient), bf16
inputs. Time = each GEMM at the GEMM rate (its own operand and output traffic is hidden inside it: every
GEMM here is compute-bound, arithmetic intensity >= bv/4 = 1024 FLOP/byte against an H200 ridge of
~200) + only the bytes that SEPARATE kernels move (the elementwise passes over the fp32 logit tiles, casts,
zero fills) at the streaming rate. Peak extra memory is the maximum over the phases of a step (forward,
backward loop, end of backward), gradients included; workspace = peak minus the gradient outputs (dh, dW
in the inputs' dtype). The formulas are written out in docs/kernels.md ("Cost model"); the chunk sizes
are the drivers' own (flashdapo.kernels.chunked / fused).

Rates (H200): GEMM 740 TFLOP/s, an ASSUMPTION of 94% of the ~790 measured on a random 8192^3 bf16
matmul, for these shapes (every GEMM dimension >= 3584 or K >= 4096); 3.4 TB/s for streaming kernels
(80% of the ~4.3 TB/s copy rate); fp32 GEMMs without TF32 (naive, impl="torch") 60 TFLOP/s. The GPU check
measures the GEMM rates at the exact shapes (bench/gpu_check.py); `--gemm-tflops` re-evaluates with them.

  python -m bench.kernel_model [--gemm-tflops 740] [--hbm-tbps 3.4]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from flashdapo.kernels.chunked import plan_chunks
from flashdapo.kernels.fused import TILE_VOCAB, fused_chunk_tokens


@dataclass(frozen=True)
class Rates:
    """Sustained rates the model assumes (see the module docstring)."""

    gemm_tflops: float = 740.0
    hbm_tbps: float = 3.4
    fp32_tflops: float = 60.0
    ceiling_tflops: float = 790.0  # the measured bf16 matmul ceiling: the 8NHV reference time


RATES = Rates()
# Every shape at N = 16384 tokens; 32B also at 32768 (Qwen2.5 hidden sizes and vocabularies).
SHAPES = {"0.5B": (16384, 896, 151936), "7B": (16384, 3584, 152064), "32B": (16384, 5120, 152064),
          "32B-32k": (32768, 5120, 152064)}
GB = 1e9


@dataclass(frozen=True)
class Cost:
    """One step of a design: GEMM FLOPs (and the rate they run at), exposed bytes, memory."""

    gemm_tflop: float
    exposed_gb: float
    peak_extra_gb: float
    workspace_gb: float
    gemm_tflops: float
    hbm_tbps: float

    @property
    def ms(self) -> float:
        return self.gemm_tflop / self.gemm_tflops * 1e3 + self.exposed_gb / self.hbm_tbps


def ideal_ms(n: int, h: int, v: int, rates: Rates = RATES) -> float:
    """8 N H V at the measured ceiling: the reference every design is held to."""
    return 8 * n * h * v / (rates.ceiling_tflops * 1e12) * 1e3


def naive(n, h, v, rates: Rates = RATES) -> Cost:
    """fp32 logits: the fp32 GEMMs (6 NHV; operands upcast: 4 (N + V) H read, 2 ... written), then ~14
    passes of 4 N V bytes (log_softmax, its backward, /T, gather/scatter); peak: logits, their log-softmax
    and their gradient at once, plus fp32 copies of W and h and the gradients."""
    nv = n * v
    exposed = 14 * 4 * nv + 6 * (n + v) * h
    peak = 3 * 4 * nv + 8 * v * h + 6 * n * h
    return Cost(6 * n * h * v / 1e12, exposed / GB, peak / GB, (peak - 2 * (v + n) * h) / GB, rates.fp32_tflops,
                rates.hbm_tbps)


def generic(n, h, v, live: float = 1.0, rates: Rates = RATES, dtype_bytes: int = 2) -> Cost:
    """The generic driver (token_logprobs, impl="triton"): forward GEMM z (hidden) + stats pass reading z
    (4 N V); backward over the live rows n_a, vocabulary outer: recompute GEMM z (hidden), grad pass
    reading z and writing dz (4 + b) n_a V, dW[chunk] = dz^T h and dh += dz W[chunk] inside the GEMMs
    (hidden); the fp32 dh cast to h's dtype (4 + b) n_a H. Peak: the backward loop's dW + fp32 dh + dz
    buffer + one z tile."""
    plan = plan_chunks(n, v, "cuda", dz_bytes=dtype_bytes)
    na = int(n * live)
    bn, bv = min(na, plan.chunk_tokens), plan.chunk_vocab
    exposed = 4 * n * v + (4 + dtype_bytes) * na * v + (4 + dtype_bytes) * na * h
    loop = dtype_bytes * v * h + 4 * na * h + dtype_bytes * na * bv + 4 * bn * bv
    end = dtype_bytes * v * h + (4 + dtype_bytes) * na * h
    forward = 4 * plan.chunk_tokens * plan.chunk_vocab
    peak = max(loop, end, forward) + 12 * n
    grads = dtype_bytes * (v + n) * h
    return Cost((2 + 6 * live) * n * h * v / 1e12, exposed / GB, peak / GB, (peak - grads) / GB,
                rates.gemm_tflops, rates.hbm_tbps)


def fused(n, h, v, rates: Rates = RATES, dtype_bytes: int = 2) -> Cost:
    """The fused sweep (fused_token_loss, impl="triton"): per token chunk of C rows, GEMM z tiles (hidden)
    kept for the whole vocabulary, stats pass reading them (4 C V), grad pass reading them and writing dz
    (4 + b) C V; dh_t += dz W and the fp32 dW accumulator += dz^T h inside the GEMMs (hidden); then the
    accumulator's zero fill (4 V H) and its cast to W's dtype (4 + b) V H, dh's per-chunk cast
    (4 + b) N H. Peak: the fp32 accumulator + the tile set + the final gradients."""
    c, bv = fused_chunk_tokens(n, v, "cuda"), TILE_VOCAB
    exposed = (8 + dtype_bytes) * n * v + (8 + dtype_bytes) * v * h + (4 + dtype_bytes) * n * h
    sweep = 4 * v * h + 4 * c * v + dtype_bytes * c * bv + 4 * c * h + dtype_bytes * n * h
    end = (4 + dtype_bytes) * v * h + dtype_bytes * n * h
    peak = max(sweep, end) + 16 * n
    grads = dtype_bytes * (v + n) * h
    return Cost(6 * n * h * v / 1e12, exposed / GB, peak / GB, (peak - grads) / GB, rates.gemm_tflops,
                rates.hbm_tbps)


def torch_impl(n, h, v, rates: Rates = RATES) -> Cost:
    """impl="torch" on a GPU: the generic plan in fp32 operands (no TF32: the fp32 GEMM rate), its
    elementwise passes as torch ops (~6 passes of 4 N V bytes each way, forward and backward)."""
    base = generic(n, h, v, rates=rates, dtype_bytes=4)
    return replace(base, exposed_gb=(48 * n * v + 8 * n * h) / GB, gemm_tflops=rates.fp32_tflops)


def predict(provider: str, shape: str, rates: Rates = RATES) -> Cost | None:
    """The modelled cost of `provider` at a named shape (bf16 inputs), or None when not modelled."""
    n, h, v = SHAPES[shape]
    models = {"naive": lambda: naive(n, h, v, rates), "torch": lambda: torch_impl(n, h, v, rates),
              "triton": lambda: generic(n, h, v, rates=rates), "triton-50%": lambda: generic(n, h, v, 0.5, rates),
              "triton-fused": lambda: fused(n, h, v, rates)}
    return models[provider]() if provider in models else None


MODELLED = ("naive", "triton", "triton-50%", "triton-fused")


def table(rates: Rates = RATES) -> list[str]:
    """The model as Markdown rows: per provider and shape, GEMM TFLOP, exposed GB, peak and workspace GB,
    time and its ratio to 8NHV at the ceiling."""
    lines = [f"## Modelled on an H200 (bf16; GEMMs at {rates.gemm_tflops:.0f} TFLOP/s, streaming at "
             f"{rates.hbm_tbps} TB/s; bench/kernel_model.py)", "",
             "| provider | shape (N, H, V) | GEMM TFLOP | exposed GB | peak extra GB | workspace GB | vs naive "
             "(peak) | time ms | vs 8NHV at ceiling |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for shape, (n, h, v) in SHAPES.items():
        base = predict("naive", shape, rates)
        for p in MODELLED:
            c = predict(p, shape, rates)
            lines.append(f"| {p} | {shape} ({n}, {h}, {v}) | {c.gemm_tflop:.1f} | {c.exposed_gb:.1f} | "
                         f"{c.peak_extra_gb:.2f} | {c.workspace_gb:.2f} | {base.peak_extra_gb / c.peak_extra_gb:.1f}x "
                         f"less | {c.ms:.0f} | {c.ms / ideal_ms(n, h, v, rates):.2f}x |")
    return lines + [""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemm-tflops", type=float, default=RATES.gemm_tflops)
    parser.add_argument("--hbm-tbps", type=float, default=RATES.hbm_tbps)
    parser.add_argument("--ceiling-tflops", type=float, default=RATES.ceiling_tflops)
    args = parser.parse_args(argv)
    rates = Rates(args.gemm_tflops, args.hbm_tbps, RATES.fp32_tflops, args.ceiling_tflops)
    print("\n".join(table(rates)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

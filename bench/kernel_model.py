"""Analytic cost of each log-prob provider on a GPU, from exposed bytes: GEMM time + separate kernels' bytes.

The formulas are `flashdapo/kernels/cost.py` (written out in docs/kernels.md, "Cost model"); this is their
table at the Qwen2.5 shapes, on the GPU named by `--gpu` (its datasheet figures, flashdapo/plan/gpus.py, at
the sustained fractions measured on an H200: GEMM 740 of 989 TFLOP/s, streaming 3.4 of 4.8 TB/s). The GPU
check measures the GEMM rates at the exact shapes (bench/gpu_check.py); `--gemm-tflops` re-evaluates with
them.

  python -m bench.kernel_model [--gpu h20] [--gemm-tflops 740] [--hbm-tbps 3.4]
"""

from __future__ import annotations

import argparse

from flashdapo.kernels.cost import GB, RATES, Cost, Rates, fused, generic, ideal_ms, naive, torch_impl
from flashdapo.kernels.gpus import GPUS, gpu_named

# Every shape at N = 16384 tokens; 32B also at 32768 (Qwen2.5 hidden sizes and vocabularies).
SHAPES = {"0.5B": (16384, 896, 151936), "7B": (16384, 3584, 152064), "32B": (16384, 5120, 152064),
          "32B-32k": (32768, 5120, 152064)}


def predict(provider: str, shape: str, rates: Rates = RATES) -> Cost | None:
    """The modelled cost of `provider` at a named shape (bf16 inputs), or None when not modelled."""
    n, h, v = SHAPES[shape]
    models = {"naive": lambda: naive(n, h, v, rates), "torch": lambda: torch_impl(n, h, v, rates),
              "triton": lambda: generic(n, h, v, rates=rates), "triton-50%": lambda: generic(n, h, v, 0.5, rates),
              "triton-fused": lambda: fused(n, h, v, rates)}
    return models[provider]() if provider in models else None


MODELLED = ("naive", "triton", "triton-50%", "triton-fused")


def table(rates: Rates = RATES, gpu_label: str = "an H200") -> list[str]:
    """The model as Markdown rows: per provider and shape, GEMM TFLOP, exposed GB, peak and workspace GB,
    time and its ratio to 8NHV at the ceiling."""
    lines = [f"## Modelled on {gpu_label} (bf16; GEMMs at {rates.gemm_tflops:.0f} TFLOP/s, streaming at "
             f"{rates.hbm_tbps:.2f} TB/s; bench/kernel_model.py)", "",
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
    parser.add_argument("--gpu", default="h200", choices=sorted(GPUS),
                        help="the GPU whose datasheet rates the model scales to (default h200)")
    parser.add_argument("--gemm-tflops", type=float, default=None, help="sustained bf16 GEMM rate (overrides)")
    parser.add_argument("--hbm-tbps", type=float, default=None, help="streaming rate (overrides)")
    parser.add_argument("--ceiling-tflops", type=float, default=None, help="the 8NHV reference rate (overrides)")
    args = parser.parse_args(argv)
    gpu = gpu_named(args.gpu)
    base = gpu.kernel_rates()
    rates = Rates(args.gemm_tflops or base.gemm_tflops, args.hbm_tbps or base.hbm_tbps, base.fp32_tflops,
                  args.ceiling_tflops or base.ceiling_tflops)
    print("\n".join(table(rates, f"an {gpu.name}")))
    return 0


__all__ = ["GB", "MODELLED", "RATES", "SHAPES", "Cost", "Rates", "fused", "generic", "ideal_ms", "main", "naive",
           "predict", "table", "torch_impl"]

if __name__ == "__main__":
    raise SystemExit(main())

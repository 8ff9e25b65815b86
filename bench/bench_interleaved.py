"""Kernel providers interleaved round by round in ONE process: time as ratios against a baseline.

`bench.bench_kernels` runs each provider in a fresh process, which measures memory cleanly but lets a
shared machine's load change between providers. Here every round runs each provider once, in turn, so
all of them see the same load; the table gives the median per provider of process CPU time (robust to
other processes taking the cores) and of wall time, each as a ratio to the baseline provider (the last
one given, e.g. Liger's loss). Memory is not measured here (one process shares its allocator): use
bench.bench_kernels for it.

  python -m bench.bench_interleaved --threads 1 --rounds 3 \
      --providers torch,torch-fused,gemm-floor,liger-dapo        # table -> bench/results/
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch

from bench.bench_kernels import (
    CPU_SHAPES,
    REPO,
    SMOKE_SHAPE,
    Unavailable,
    git_commit,
    machine_tag,
    make_inputs,
    make_step,
    write_report,
)


def run_rounds(providers, shape, device: str, rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    """{provider: (process CPU seconds per round, wall seconds per round)}; unavailable ones left out."""
    _, n, hdim, vocab, dtype, _ = shape
    h, w, y, g = make_inputs(n, hdim, vocab, getattr(torch, dtype), torch.device(device))
    steps = {}
    for p in providers:
        try:
            steps[p] = make_step(p, h, w, y, g)
        except Unavailable as why:
            print(f"{p}: skipped ({why})", flush=True)
    for step in steps.values():  # warm-up: compiles, first-touch page faults
        h.grad = w.grad = None
        step()
    times = {p: ([], []) for p in steps}
    for r in range(rounds):
        for p, step in steps.items():
            h.grad = w.grad = None
            if device == "cuda":
                torch.cuda.synchronize()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            times[p][0].append(time.process_time() - cpu0)
            times[p][1].append(time.perf_counter() - wall0)
            print(f"round {r + 1}/{rounds} {p}: {times[p][0][-1]:.2f} s CPU, {times[p][1][-1]:.2f} s wall", flush=True)
    return times


def table(times, shape, threads: int, commit: str, device: str) -> str:
    label, n, hdim, vocab, dtype, _ = shape
    base = list(times)[-1]
    med = {p: (statistics.median(c), statistics.median(w)) for p, (c, w) in times.items()}
    lines = [f"# Kernel providers interleaved: {machine_tag(device)}, commit {commit}, {datetime.date.today()}", "",
             f"{label}: N={n} H={hdim} V={vocab} {dtype}; torch {torch.__version__}, {threads} thread(s), "
             f"load average at end {os.getloadavg()[0]:.1f}; median of {len(times[base][0])} rounds, "
             f"providers in turn each round (bench/bench_interleaved.py)", "",
             f"| provider | CPU time (s) | vs {base} | wall (s) | vs {base} | rounds, CPU s |",
             "|---|---:|---:|---:|---:|---|"]
    for p, (c, w) in med.items():
        rounds = ", ".join(f"{x:.2f}" for x in times[p][0])
        lines.append(f"| {p} | {c:.2f} | {c / med[base][0]:.3f}x | {w:.2f} | {w / med[base][1]:.3f}x | {rounds} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default="torch,torch-fused,gemm-floor,liger-dapo",
                        help="comma-separated; the last one is the baseline of the ratios")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", default="cpu", help="'cpu' (the CPU target shape) or 'smoke'")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results"))
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SMOKE_SHAPE if args.shape == "smoke" else CPU_SHAPES[0]
    commit = git_commit()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        times = run_rounds(args.providers.split(","), shape, device, args.rounds)
    finally:
        torch.set_num_threads(threads_before)  # a caller's (e.g. pytest's) thread count is left as it was
    write_report(table(times, shape, args.threads, commit, device), args.out, device, commit,
                 f"-interleaved-{args.threads}t")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

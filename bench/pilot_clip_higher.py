"""Pilot of the Clip-Higher panel under the reward-free control (random verifier): paired seeds, two arms
that differ only in algorithm.clip_high, judged by probe/entropy averaged over the last steps.

Runs `python -m flashdapo train` once per (seed, arm), `--jobs` at a time, each in its own run directory,
then reads every metrics.jsonl and prints the per-seed values, the paired differences (high - low), their
mean and 95% t-interval, and the clip statistics of each arm. A finished run directory is reused, so the
script can be rerun with more seeds or only to analyse (`--analyse-only`).

    PYTHONPATH=$PWD python bench/pilot_clip_higher.py --seeds 0 1 2 --steps 30 --set optim.lr=1e-3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Two-sided 95% quantiles of Student's t by degrees of freedom."""

BASE_OVERRIDES = {
    "algorithm.verifier": "random", "algorithm.random_reward_p": "0.5",
    "trainer.val_before_train": "false", "trainer.val_every": "0",
    "checkpoint.save_every": "0", "checkpoint.export_hf": "false", "logging.plot": "false",
}
"""What every pilot run shares besides the preset: the reward-free control, and no validation, checkpoints,
export or plot (the panel's metric is the probe; these only cost time)."""


def shared_base(args: argparse.Namespace) -> dict[str, str]:
    """As `flashdapo ablate` does: warm the preset's model up once (seed --base-seed) and write the task as
    data files; every run starts from that base (model.path) on those files, so seeds differ only in RL."""
    from flashdapo.ablation.arms import nested
    from flashdapo.ablation.base import build_base, write_task_files
    from flashdapo.config import merge
    from flashdapo.config.presets import preset

    cfg = merge(preset(args.preset), nested(base_fields(args)))
    cfg.trainer.seed = args.base_seed
    base_dir = Path(args.out) / "base"
    build_base(cfg, base_dir)
    train_file, val_file = write_task_files(cfg, Path(args.out) / "data")
    return {"model.path": str(base_dir.resolve()), "data.train_files": str(train_file.resolve()),
            "data.val_files": str(val_file.resolve())}


def base_fields(args: argparse.Namespace) -> dict:
    """--set fields the base model depends on (model.toy.*, data.*): given to the warm-up too."""
    import yaml

    return {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)
            if k.startswith(("model.toy.", "data."))}


def flag(field: str, value: str) -> list[str]:
    section, name = field.split(".", 1)
    return [f"--{section}.{name.replace('_', '-')}", value]


def run_one(args: argparse.Namespace, seed: int, clip_high: str, overrides: dict[str, str]) -> tuple[float, float]:
    """Train one arm of one seed (skipped when its metrics are complete); returns its wall time and its CPU
    time (user + system, s): on a shared machine the CPU time bounds what the run takes when quiet."""
    run_dir = Path(args.out) / f"ch{clip_high}-s{seed}"
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and any(json.loads(line).get("step") == args.steps for line in metrics.open()):
        return float("nan"), float("nan")
    settings = {**BASE_OVERRIDES, **overrides, "trainer.total_steps": str(args.steps),
                "trainer.seed": str(seed), "algorithm.clip_high": clip_high, "logging.run_dir": str(run_dir),
                "logging.move_old_run": "true"}
    cmd = [sys.executable, "-m", "flashdapo", "train", "--preset", args.preset]
    for field, value in settings.items():
        cmd += flag(field, value)
    start = time.perf_counter()
    with open(Path(args.out) / f"ch{clip_high}-s{seed}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"{run_dir}: exit status {status}")
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def window_mean(run_dir: Path, key: str, first_step: int) -> float:
    values = [row[key] for row in map(json.loads, (run_dir / "metrics.jsonl").open())
              if row.get("step", 0) >= first_step and key in row]
    return sum(values) / len(values) if values else float("nan")


def paired(diffs: list[float]) -> tuple[float, float, float]:
    """Mean and the 95% t-interval of paired differences."""
    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return mean, float("nan"), float("nan")
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = T975[n - 1] * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def analyse(args: argparse.Namespace) -> None:
    first = args.steps - args.window + 1
    keys = ["probe/entropy", "probe/top1_prob", "actor/entropy", "actor/clipfrac_upper", "actor/clipfrac_lower",
            "actor/upclip_old_prob", "actor/upclip_tail_fraction", "actor/ppo_kl", "response_length/mean"]
    print(f"window: steps {first}..{args.steps}")
    for key in keys:
        rows, diffs = [], []
        for seed in args.seeds:
            low = window_mean(Path(args.out) / f"ch{args.low}-s{seed}", key, first)
            high = window_mean(Path(args.out) / f"ch{args.high}-s{seed}", key, first)
            rows.append(f"s{seed}: {low:.4f} / {high:.4f} ({high - low:+.4f})")
            diffs.append(high - low)
        mean, lo, hi = paired(diffs)
        print(f"{key:24s} {args.low}/{args.high}  " + "  ".join(rows) +
              f"  | mean diff {mean:+.4f}, 95% CI [{lo:+.4f}, {hi:+.4f}]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="toy")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--window", type=int, default=10, help="last steps averaged")
    p.add_argument("--probe-every", type=int, default=2)
    p.add_argument("--low", default="0.2")
    p.add_argument("--high", default="0.28")
    p.add_argument("--set", action="append", default=[],
                   help="FIELD=VALUE (dotted field), repeatable; model.toy.* and data.* fields shape the warm-up too")
    p.add_argument("--base-seed", type=int, default=0, help="seed of the one shared warm-up")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default="runs/pilot_clip_higher")
    p.add_argument("--analyse-only", action="store_true")
    args = p.parse_args()
    overrides = {"logging.probe_every": str(args.probe_every)}
    overrides.update(dict(item.split("=", 1) for item in args.set))
    os.makedirs(args.out, exist_ok=True)
    if not args.analyse_only:
        print("load average before:", os.getloadavg())
        overrides = {**shared_base(args), **overrides}
        jobs = [(seed, ch) for seed in args.seeds for ch in (args.low, args.high)]
        with ThreadPoolExecutor(args.jobs) as pool:
            times = list(pool.map(lambda job: run_one(args, job[0], job[1], overrides), jobs))
        for (seed, ch), (wall, cpu) in zip(jobs, times):
            print(f"seed {seed} clip_high {ch}: {wall:.0f} s wall, {cpu:.0f} s CPU")
        print("load average after:", os.getloadavg())
    analyse(args)


if __name__ == "__main__":
    main()

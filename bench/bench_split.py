"""Split placement on the CPU: s/step co-located on 2 ranks vs split 1 trainer + 1 rollout rank at k = 0, 1.

Arms, each a `torchrun --nproc_per_node 2 -m flashdapo train` run of the same config and steps (so the
same trained samples: train_batch groups per step):

- `colocated`: both ranks generate, then both train (today's placement).
- `split-k0`: `--rollout.placement split --rollout.rollout-ranks 1 --rollout.max-lag 0` (synchronous).
- `split-k1`: the same with `--rollout.max-lag 1` (one-step-off: batch b sampled with the weights of b - 2).

Workloads: `toy` (the default preset) and `longtail` (the long-tail preset: heavy-tailed response lengths).
Each base model is warmed up once and every run trains from it on data files (bench/bench_longtail.py's
`prepare`). One thread per process (OMP_NUM_THREADS=1), no validation or checkpoints. The arms of a repeat
run one after another in an order that rotates between repeats, with the same seed; the table gives each
figure's median over repeats [min, max] and its ratio to the same repeat's co-located run.

Per run, from metrics.jsonl: s/step = mean `timing_s/step` over steps 2..; the split arms' own metrics
(`split/trainer_idle`, `split/rollout_idle`, `split/lag_mean`, `split/lag_max`,
`split/weight_push_s`, `split/weight_push_bytes`, `split/batch_transfer_s`) where logged. The
co-located arm's trainer idles while it generates (idle = `timing_s/gen` / `timing_s/step`) and its
rollout while it trains (1 - that); its lag is 0.

This measures the toy's bookkeeping on a shared 2-core CPU: fixed overheads dominate, and nothing here
says what split placement does on a GPU (bench/split_sim.py simulates that, labelled as simulated).

    python -m bench.bench_split [--workloads toy,longtail] [--arms colocated,split-k0,split-k1] [--repeats 3]
    python -m bench.bench_split --smoke       # seconds: a tiny model, 2 steps, co-located on 1 rank in this
                                              # process (split arms: 1 + 1 under torchrun)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.bench_longtail import COMMON, SMOKE, prepare

REPO = Path(__file__).resolve().parent.parent
ARMS = {"colocated": None, "split-k0": 0, "split-k1": 1}
"""Each arm's max lag (None: co-located)."""
WORKLOADS = ("toy", "longtail")
SPLIT_KEYS = ("split/trainer_idle", "split/rollout_idle", "split/lag_mean", "split/lag_max",
              "split/weight_push_s", "split/weight_push_bytes", "split/batch_transfer_s")


@dataclass(frozen=True)
class ArmResult:
    """What one run measured (NaN: the run did not log it)."""

    s_per_step: float
    trainer_idle: float
    rollout_idle: float
    lag_mean: float
    lag_max: float
    weight_broadcast_s: float
    weight_broadcast_bytes: float
    batch_transfer_s: float
    trained_groups: float


def split_supported() -> bool:
    """Whether this checkout's config has split placement (rollout.placement)."""
    from flashdapo.config.sampling import RolloutConfig

    return "placement" in {f.name for f in dataclasses.fields(RolloutConfig)}


def split_flags(lag: int | None) -> list[str]:
    """The command-line fields of an arm."""
    if lag is None:
        return []
    return ["--rollout.placement", "split", "--rollout.rollout-ranks", "1", "--rollout.max-lag", str(lag)]


def workload(name: str, smoke: bool):
    """A workload's config with the bench's settings (and the smoke shape)."""
    from flashdapo.config import merge, preset

    cfg = merge(preset(name), COMMON)
    return merge(cfg, SMOKE) if smoke else cfg


def run_arm(cfg, preset: str, lag: int | None, ranks: int, in_process: bool, timeout: int) -> list[dict]:
    """One `flashdapo train` run (fresh run directory, one thread per process); its step records."""
    from bench.bench_longtail import run_arm as run_train

    return run_train(cfg, ranks, in_process, timeout, preset=preset, flags=tuple(split_flags(lag)),
                     env={"OMP_NUM_THREADS": "1"}, bench="bench_split")


def _mean(history: list[dict], key: str) -> float:
    values = [r[key] for r in history if key in r]
    return statistics.fmean(values) if values else float("nan")


def summarize(history: list[dict], colocated: bool) -> ArmResult:
    """A run's figures from its step records (module docstring)."""
    timed = history[1:] or history
    if colocated:
        gen_share = statistics.fmean(r["timing_s/gen"] / r["timing_s/step"] for r in timed)
        idle = (gen_share, 1 - gen_share, 0.0, 0.0)
    else:
        idle = (_mean(timed, "split/trainer_idle"), _mean(timed, "split/rollout_idle"),
                _mean(history, "split/lag_mean"), max(r.get("split/lag_max", float("nan")) for r in history))
    return ArmResult(
        s_per_step=statistics.fmean(r["timing_s/step"] for r in timed), trainer_idle=idle[0], rollout_idle=idle[1],
        lag_mean=idle[2], lag_max=idle[3], weight_broadcast_s=_mean(timed, "split/weight_push_s"),
        weight_broadcast_bytes=_mean(timed, "split/weight_push_bytes"),
        batch_transfer_s=_mean(timed, "split/batch_transfer_s"),
        trained_groups=statistics.fmean(r.get("train/kept_groups", float("nan")) for r in history))


def run_all(bases: dict, arms: list[str], repeats: int, ranks: int, work: Path, in_process: bool, timeout: int,
            log=print) -> dict[tuple[str, str], list[ArmResult]]:
    """Every (workload, arm) run of every repeat; within a repeat the arms' order rotates."""
    from flashdapo.config import merge

    results: dict[tuple[str, str], list[ArmResult]] = {(w, a): [] for w in bases for a in arms}
    for rep in range(repeats):
        for name, base in bases.items():
            for arm in arms[rep % len(arms):] + arms[:rep % len(arms)]:
                cfg = merge(base, {"trainer": {"seed": rep},
                                   "logging": {"run_dir": str(work / "runs" / f"{name}-{arm}-r{rep}")}})
                lag = ARMS[arm]
                result = summarize(run_arm(cfg, name, lag, ranks if lag is None else 2, in_process, timeout), lag is None)
                results[(name, arm)].append(result)
                log(f"bench_split: repeat {rep} {name} {arm}: {result.s_per_step:.3f} s/step, trainer idle "
                    f"{result.trainer_idle:.2f}, rollout idle {result.rollout_idle:.2f}")
    return results


def _cell(values: list[float], fmt: str) -> str:
    values = [v for v in values if v == v]  # NaN: not logged
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


COLUMNS = (("s_per_step", ".3f"), ("trainer_idle", ".2f"), ("rollout_idle", ".2f"), ("lag_mean", ".2f"),
           ("lag_max", ".0f"), ("weight_broadcast_s", ".4f"), ("weight_broadcast_bytes", ".3g"),
           ("batch_transfer_s", ".4f"), ("trained_groups", ".1f"))


def table(results: dict[tuple[str, str], list[ArmResult]], workloads: list[str], arms: list[str]) -> list[str]:
    """Markdown: per (workload, arm) medians [min, max] over repeats, and s/step paired with co-located."""
    lines = ["| workload | arm | s/step | s/step / co-located | trainer idle | rollout idle | lag mean | lag max | "
             "weight push s | weight push bytes | batch transfer s | trained groups / step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in workloads:
        base = results.get((w, "colocated"))
        for arm in arms:
            rs = results[(w, arm)]
            cells = [w, arm, _cell([r.s_per_step for r in rs], ".3f"),
                     _cell([a.s_per_step / b.s_per_step for a, b in zip(rs, base)], ".3f") if base else "-"]
            cells += [_cell([getattr(r, name) for r in rs], fmt) for name, fmt in COLUMNS[1:]]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(results, workloads: list[str], arms: list[str], args, commit: str) -> str:
    """The results file: machine, commit, settings, table."""
    import torch

    from bench.bench_kernels import machine_tag

    return "\n".join([
        f"# Split placement on the CPU: {machine_tag('cpu')}, commit {commit}, {datetime.date.today()}", "",
        f"{os.cpu_count()} CPUs, shared; torch {torch.__version__}; one thread per process; load average at the "
        f"end {os.getloadavg()[0]:.1f}. `{' '.join(['python -m bench.bench_split', *sys.argv[1:]])}`", "",
        f"Measured: {args.steps} steps per run, {args.repeats} repeats (seed = repeat), arms in rotating order; "
        "each cell the median over repeats [min, max]; `s/step / co-located` paired within a repeat. "
        "A toy on a shared 2-core CPU: fixed overheads dominate; not a GPU prediction.", "",
        *table(results, workloads, arms), ""])


def main(argv=None) -> int:
    from bench.bench_kernels import git_commit, write_result
    from flashdapo.config import merge

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {list(WORKLOADS)}")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="training steps per run")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model, 2 steps, the first workload; co-located on 1 rank in this process")
    parser.add_argument("--work", default=str(REPO / "runs" / "bench-split"), help="base models and runs")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := sorted(set(arms) - set(ARMS)) + sorted(set(workloads) - set(WORKLOADS)):
        parser.error(f"unknown {unknown}; arms: {list(ARMS)}, workloads: {list(WORKLOADS)}")
    if any(ARMS[a] is not None for a in arms) and not split_supported():
        print("bench_split: this checkout's config has no rollout.placement (split placement not built yet); "
              "only the co-located arm runs")
        arms = [a for a in arms if ARMS[a] is None]
        if not arms:
            return 1
    if args.smoke:
        args.steps, args.repeats, workloads = 2, 1, workloads[:1]
    ranks = 1 if args.smoke else 2
    commit, work = git_commit(), Path(args.work)
    bases = {w: prepare(merge(workload(w, args.smoke), {"trainer": {"total_steps": args.steps}}), work / w)
             for w in workloads}
    results = run_all(bases, arms, args.repeats, ranks, work, in_process=args.smoke, timeout=args.timeout)
    text = report(results, workloads, arms, args, commit)
    write_result(text, args.out, commit, f"split{'-smoke' * args.smoke}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`flashdapo ablate --ladder`: the base model once, then every (arm, seed) run in its own directory, then the
report.

Each arm's run is a plain `flashdapo train` run (its config.yaml reruns it alone) from the saved base
(`model.path` = OUT/base) on the task's problems written as data files (OUT/data/train.jsonl, val.jsonl),
with `checkpoint.resume auto`: a rerun of the ladder skips every run whose
`arm.json` records the same config, and continues an interrupted one from its newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from ..config import Config, merge
from ..errors import FlashdapoError
from .arms import ARMS, Arm, arm_config, arm_fields, arm_index
from .base import BaseStatistics, base_settings, base_statistics, build_base, write_task_files
from .options import AblateOptions, ladder_seeds
from .records import ArmRun, samples_generated
from .report import write_report

DONE_MARKER = "arm.json"


class AblationError(FlashdapoError, ValueError):
    """The output directory holds a different ladder's run for an arm; the message says what to do."""


def arm_run_dir(out: Path, arm: Arm, seed: int) -> Path:
    return out / "arms" / arm.name / f"seed{seed}"


def planned_runs(base: Config, opts: AblateOptions, base_dir: Path) -> list[tuple[Arm, int, Config]]:
    """(arm, seed, config) of every run, in ladder order, seeds inner."""
    train_file, val_file = write_task_files(base, Path(opts.out) / "data")
    common = merge(
        base, {
            "model": {"path": str(base_dir.resolve())}, "data": {
                "train_files": [str(train_file.resolve())], "val_files": [str(val_file.resolve())]
            }, "checkpoint": {"resume": "auto", "export_hf": False}, "logging": {"progress": opts.step_lines}
        })
    out = Path(opts.out)
    runs = []
    for arm in sorted((ARMS[arm_index(n)] for n in opts.arms), key=lambda a: arm_index(a.name)):
        arm_cfg = arm_config(arm_index(arm.name), common)
        for seed in range(ladder_seeds(opts)):
            cfg = merge(arm_cfg, {"trainer": {"seed": seed},
                                  "logging": {"run_dir": str(arm_run_dir(out, arm, seed))}})
            runs.append((arm, seed, cfg))
    return runs


def run_ablation(base: Config, opts: AblateOptions, log: Callable[[str], None] = print) -> list[ArmRun]:
    """The whole ladder: base model, base statistics, every arm and seed, ablation.md and ablation.png."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    base_dir = out / "base"
    build_base(base, base_dir, log)
    stats = _base_stats(base, base_dir, opts, out, log)
    plan = planned_runs(base, opts, base_dir)
    write_arm_settings(out, base, plan, log)
    runs = []
    started = time.perf_counter()
    for number, (arm, seed, cfg) in enumerate(plan, start=1):
        run = _run_arm(arm, seed, cfg)
        runs.append(run)
        log(progress_line(number, len(plan), run, time.perf_counter() - started))
    kept = finished_elsewhere(base, opts, base_dir, plan)
    if kept:
        names = ", ".join(dict.fromkeys(f"{r.arm.name}" for r in kept))
        log(f"ablation: the report keeps {len(kept)} finished run(s) of other arms in {out} ({names})")
    md, png = write_report(out, runs + kept, stats, base)
    log(f"ablation: wrote {md} and {png}")
    return runs


def finished_elsewhere(base: Config, opts: AblateOptions, base_dir: Path,
                       plan: list[tuple[Arm, int, Config]]) -> list[ArmRun]:
    """Runs of arms this call does not run that an earlier `flashdapo ablate` finished in the same OUT with
    the config this ladder gives them (their arm.json): a rerun of some arms keeps the others' rows in the
    report. A run finished with another config (another ladder) is left out."""
    out, asked = Path(opts.out), {arm.name for arm, _, _ in plan}
    seeds = {a.name: [int(p.name[4:]) for p in (out / "arms" / a.name).glob("seed*") if p.name[4:].isdigit()]
             for a in ARMS if a.name not in asked}
    others = [name for name, found in seeds.items() if found]
    if not others:
        return []
    wider = dataclasses.replace(opts, arms=others, seeds=max(max(seeds[n]) for n in others) + 1)
    kept = []
    for arm, seed, cfg in planned_runs(base, wider, base_dir):
        marker = Path(cfg.logging.run_dir) / DONE_MARKER
        if marker.is_file() and json.loads(marker.read_text()).get("config") == cfg.to_dict():
            kept.append(_run_arm(arm, seed, cfg))  # finished: read back, nothing rerun
    return kept


def _base_stats(base: Config, base_dir: Path, opts: AblateOptions, out: Path, log) -> BaseStatistics:
    path = out / "base_statistics.json"
    key = {"settings": base_settings(base), "prompts": opts.base_probe_prompts, "n": base.rollout.n}
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            stats = BaseStatistics(**cached["statistics"])
            log(f"base model on the training prompts: {stats.summary()}")
            return stats
    stats = base_statistics(base, base_dir, prompts=opts.base_probe_prompts)
    path.write_text(json.dumps({"key": key, "statistics": asdict(stats)}, indent=1))
    log(f"base model on the training prompts: {stats.summary()}")
    return stats


def _run_arm(arm: Arm, seed: int, cfg: Config) -> ArmRun:
    history, wall, skipped = train_or_reuse(cfg, arm.name, seed)
    return ArmRun(arm, seed, cfg, Path(cfg.logging.run_dir), history, wall, skipped=skipped)


def train_or_reuse(cfg: Config, name: str, seed: int) -> tuple[list[dict], float, bool]:
    """Train cfg in its run directory, or read back a run an earlier `flashdapo ablate` finished there with
    the same config (its arm.json): (history, wall seconds, skipped). An interrupted run resumes from its
    newest checkpoint (`checkpoint.resume auto`); a run finished with another config is refused."""
    from ..trainer.loop import train
    from ..trainer.observe.sinks import read_history

    run_dir = Path(cfg.logging.run_dir)
    marker = run_dir / DONE_MARKER
    if marker.is_file():
        done = json.loads(marker.read_text())
        if done["config"] != cfg.to_dict():
            raise AblationError(
                f"{marker}: this arm finished with a different config than the ablation now asks "
                "for; choose another --out, or delete that arm's directory to rerun it")
        return read_history(run_dir / "metrics.jsonl"), done["wall_s"], True
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    start = time.perf_counter()
    finished = train(cfg)
    wall = time.perf_counter() - start
    marker.write_text(json.dumps({"arm": name, "seed": seed, "wall_s": wall, "config": cfg.to_dict()}))
    return list(finished.logger.history), wall, False


def progress_line(number: int, total: int, run: ArmRun, elapsed: float) -> str:
    """One line per finished (arm, seed): validation accuracy first -> last (best), samples, time."""
    val = [m["val/acc/mean@k"] for m in run.history if "val/acc/mean@k" in m]
    acc = f"val mean@k {val[0]:.3f} -> {val[-1]:.3f} (best {max(val):.3f})" if val else "no validation"
    how = "done before, skipped" if run.skipped else f"{run.wall_s:.0f} s"
    return (
        f"ablation: [{number}/{total}] {run.arm.name} seed {run.seed}: {acc}, {samples_generated(run):,} "
        "samples "
        f"generated, {how} | ladder {elapsed:.0f} s so far")


def write_arm_settings(out: Path, base: Config, plan: list[tuple[Arm, int, Config]], log) -> Path:
    """arms.md: each arm's fields (what it adds in bold) and the command that reruns one of its runs alone."""
    lines = [
        "# The ladder's arms", "",
        "Each arm is the base config plus these fields (the ones it adds to the arm before in **bold**). "
        "Rerun any run alone (into a new directory) with the command given.", ""
    ]
    seen = []
    for arm, _, cfg in plan:
        if arm.name in seen:
            continue
        seen.append(arm.name)
        fields = arm_fields(arm_index(arm.name), base)
        shown = ", ".join(f"**{k}={v}**" if k in arm.adds else f"{k}={v}" for k, v in fields.items())
        command = (f"flashdapo train --config {Path(cfg.logging.run_dir) / 'config.yaml'} "
                   f"--logging.run-dir runs/{arm.name}-rerun")
        lines += [f"- `{arm.name}` ({arm.label}): {shown}", f"  - `{command}`"]
        log(f"arm {arm.name}: {shown.replace('**', '')}")
    path = out / "arms.md"
    path.write_text("\n".join(lines) + "\n")
    return path

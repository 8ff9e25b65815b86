"""`flashdapo ablate` (the default): the mechanism panels of arms.py, every arm for every seed, then the
report.

Each run is a plain `flashdapo train` run (its config.yaml reruns it alone) in OUT/panels/PANEL/ARM/seedS/,
from a warmed-up base model: one per distinct task and model setting (OUT/base-TAG/, TAG a hash of those
settings, so --quick and the default share it), on that task's problems written as data files (OUT/data-TAG/).
Resumable as the ladder is: a rerun skips finished runs (arm.json), continues an interrupted one, and refuses
a directory holding a run with another config. Arms of a panel share `trainer.seed` = s for seed s: the same
data order and sampling seeds (pairs). A call that runs some panels keeps, in ablation.md, the finished runs
of the other panels an earlier call ran in the same OUT (`finished_elsewhere`), as the ladder keeps other
arms' rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError, differences, merge
from .arms import (
    PANELS,
    PROBE_AND_RANDOM_VERIFIER_FIELDS,
    Panel,
    PanelArm,
    nested,
    panel_arm_config,
    panel_arm_fields,
    panel_by_name,
    varied_fields,
)
from .base import base_settings, build_base, write_task_files
from .final_eval import FinalScore, final_evaluation, read_final_evaluation
from .options import AblateOptions, panel_seeds
from .panel_report import write_panel_report
from .records import PanelRun
from .runner import DONE_MARKER, AblationError, train_or_reuse


@dataclass(frozen=True)
class PlannedRun:
    panel: Panel
    arm: PanelArm
    seed: int
    config: Config
    base_dir: Path


@dataclass(frozen=True)
class Plan:
    runs: list[PlannedRun]
    unavailable: dict[str, str]
    """Panels this build cannot run (a field it lacks): panel name -> the config error."""
    bases: dict[Path, Config]
    """Each base directory and the config (a control arm's) it is warmed up with."""


def selected_panels(opts: AblateOptions) -> list[tuple[Panel, tuple[PanelArm, ...]]]:
    """(panel, arms to run): --quick keeps the quick panels and their quick arms; else the --panels chosen."""
    if opts.quick:
        return [(p, tuple(a for a in p.arms if a.name in p.quick_arms)) for p in PANELS if p.quick_arms]
    return [(panel_by_name(n), panel_by_name(n).arms)
            for n in sorted(opts.panels, key=[p.name for p in PANELS].index)]


def user_overrides(base: Config, start: Config | None) -> dict[str, Any]:
    """The dotted fields where `base` (the command line's config) differs from `start` (its preset and config
    file): what the user asked for, which wins over a panel's settings."""
    if start is None:
        return {}
    flat: dict[str, Any] = {}

    def walk(tree: dict, prefix: str) -> None:
        for k, v in tree.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) else flat.__setitem__(f"{prefix}{k}", v)
    walk(differences(base, start), "")
    return flat


def settings_tag(cfg: Config) -> str:
    """A short name for cfg's base-model settings (task, model, warm-up): panels, or a --quick and a default
    run, that share the settings share the base directory, whichever ran first."""
    text = json.dumps(base_settings(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def plan_panels(base: Config, opts: AblateOptions, start: Config | None = None) -> Plan:
    """Every run's config, the bases they need, and the panels this build cannot configure. Fields in which
    `base` differs from `start` (given on the command line) win over the panels' settings, except the field a
    panel varies."""
    out = Path(opts.out)
    runs, unavailable, bases = [], {}, {}
    overrides = user_overrides(base, start)
    for panel, arms in selected_panels(opts):
        clash = sorted(varied_fields(panel) & set(overrides))
        if clash:
            raise AblationError(
                f"--{clash[0].replace('_', '-')}: panel {panel.name} varies this field itself; "
                "leave it out, or choose other panels with --panels")
        try:
            control = panel_arm_config(panel, panel.control, base, overrides)
            arm_cfgs = [(arm, panel_arm_config(panel, arm, base, overrides)) for arm in arms]
        except ConfigError as err:
            if not _builds_without_newer_fields(panel, base, overrides):
                raise
            unavailable[panel.name] = str(err).split("; allowed")[0]
            continue
        tag = settings_tag(control)
        base_dir = out / f"base-{tag}"
        bases.setdefault(base_dir, control)
        train_file, val_file = write_task_files(control, out / f"data-{tag}")
        for arm, cfg in arm_cfgs:
            for seed in range(panel_seeds(opts)):
                runs.append(
                    PlannedRun(
                        panel, arm, seed,
                        merge(
                            cfg, {
                                "model": {"path": str(base_dir.resolve())}, "data": {
                                    "train_files": [str(train_file.resolve())],
                                    "val_files": [str(val_file.resolve())]
                                }, "trainer": {"seed": seed}, "checkpoint": {
                                    "resume": "auto", "export_hf": panel.final_eval and opts.final_eval_k > 0
                                }, "logging": {
                                    "progress": opts.step_lines, "run_dir": str(
                                        out / "panels" / panel.name / arm.name / f"seed{seed}")
                                }
                            }), base_dir))
    return Plan(runs, unavailable, bases)


def _builds_without_newer_fields(panel: Panel, base: Config, overrides: dict[str, Any]) -> bool:
    """Whether the panel's configs build once the random verifier's and the probe's fields are left out: then
    only those are missing from this build (any other config error is the user's, and is raised)."""
    try:
        for arm in panel.arms:
            fields = panel_arm_fields(panel, arm, base, overrides)
            merge(base, nested({k: v
                                for k, v in fields.items() if k not in PROBE_AND_RANDOM_VERIFIER_FIELDS}))
    except ConfigError:
        return False
    return True


def run_panels(base: Config, opts: AblateOptions, log: Callable[[str], None] = print,
               start: Config | None = None) -> list[PanelRun]:
    """The panels: bases, every (panel, arm, seed) run, final evaluations, ablation.md and a picture per
    panel. `start`: the preset (and config file) `base` was made from; what differs wins over the panels'
    settings."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = plan_panels(base, opts, start)
    for name, error in plan.unavailable.items():
        log(f"ablation: panel {name} not run: this build lacks a field it needs ({error})")
    for base_dir, cfg in plan.bases.items():
        build_base(cfg, base_dir, log)
    runs, started = [], time.perf_counter()
    for number, planned in enumerate(plan.runs, start=1):
        run = _run(planned, opts)
        runs.append(run)
        log(panel_progress_line(number, len(plan.runs), run, time.perf_counter() - started))
    kept = finished_elsewhere(base, opts, start)
    if kept:
        names = ", ".join(dict.fromkeys(r.panel.name for r in kept))
        log(f"ablation: the report keeps {len(kept)} finished run(s) of other panels in {out} ({names})")
    md = write_panel_report(out, runs + kept, plan.unavailable, base, opts)
    log(f"ablation: wrote {md} and a picture per panel (panel-*.png)")
    return runs


def finished_elsewhere(base: Config, opts: AblateOptions, start: Config | None = None) -> list[PanelRun]:
    """Runs of panels this call does not run that an earlier `flashdapo ablate` finished in the same OUT with
    the config these options give them (their arm.json), read back with their final evaluations: a rerun with
    other panels keeps the earlier panels' sections in ablation.md. A run finished with another config is left
    out."""
    out, asked = Path(opts.out), {panel.name for panel, _ in selected_panels(opts)}
    seeds = {
        p.name: [int(d.name[4:]) for d in (out / "panels" / p.name).glob("*/seed*") if d.name[4:].isdigit()]
        for p in PANELS if p.name not in asked
    }
    others = [name for name, found in seeds.items() if found]
    if not others:
        return []
    wider = dataclasses.replace(opts, panels=others, quick=False,
                                seeds=max(max(seeds[n]) for n in others) + 1)
    try:
        plan = plan_panels(base, wider, start)
    except (AblationError, ConfigError):  # the options now clash with a panel not run: nothing of it to keep
        return []
    kept = []
    for planned in plan.runs:
        run_dir = Path(planned.config.logging.run_dir)
        marker = run_dir / DONE_MARKER
        if marker.is_file() and json.loads(marker.read_text()).get("config") == planned.config.to_dict():
            history, wall, _ = train_or_reuse(planned.config, f"{planned.panel.name}/{planned.arm.name}",
                                              planned.seed)  # finished: read back, nothing rerun
            final = read_final_evaluation(run_dir) if planned.panel.final_eval else []
            kept.append(
                PanelRun(planned.panel, planned.arm, planned.seed, planned.config, history, wall, True,
                         final))
    return kept


def _run(planned: PlannedRun, opts: AblateOptions) -> PanelRun:
    cfg = planned.config
    history, wall, skipped = train_or_reuse(cfg, f"{planned.panel.name}/{planned.arm.name}", planned.seed)
    final: list[FinalScore] = []
    if planned.panel.final_eval and opts.final_eval_k > 0:
        final = final_evaluation(cfg, opts.final_eval_k)
    elif planned.panel.final_eval:
        final = read_final_evaluation(Path(cfg.logging.run_dir))
    return PanelRun(planned.panel, planned.arm, planned.seed, cfg, history, wall, skipped, final)


def panel_progress_line(number: int, total: int, run: PanelRun, elapsed: float) -> str:
    """One line per finished run: the panel's metric for it, and the time."""
    value = run.value(run.panel.metric)
    shown = "not logged" if value is None else f"{value:.4g}"
    how = "done before, skipped" if run.skipped else f"{run.wall_s:.0f} s"
    return (f"ablation: [{number}/{total}] {run.panel.name} {run.arm.name} seed {run.seed}: "
            f"{run.panel.metric.name} {shown}, {how} | panels {elapsed:.0f} s so far")

"""The panels' report: OUT/ablation.md (per panel: the pre-registered metric's paired differences, 95% t
interval, p-value, Holm-corrected p across every comparison of the report, separated or not; the secondary
metrics; the final evaluation) and OUT/panel-NAME.png (the metric's logged quantity over steps, seeds thin,
their mean thick)."""

from __future__ import annotations

import math
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path

from ..config import Config
from .arms import LAST_FRACTION, Measure, Panel, PanelArm, last_steps
from .base import provenance
from .options import AblateOptions
from .records import PanelRun
from .stats import PairedTest, StatsError, holm, paired_test


@dataclass(frozen=True)
class Comparison:
    """One treatment against its panel's control on the panel's metric, paired by seed."""

    panel: Panel
    treatment: PanelArm
    control_values: tuple[float, ...]
    treatment_values: tuple[float, ...]
    test: PairedTest | None
    """None with fewer than 2 seeds holding the metric in both arms."""
    why_not: str = ""


def _arm_runs(runs: list[PanelRun], panel: Panel, arm: PanelArm) -> dict[int, PanelRun]:
    return {r.seed: r for r in runs if r.panel.name == panel.name and r.arm.name == arm.name}


def compare(runs: list[PanelRun], panel: Panel, treatment: PanelArm) -> Comparison:
    """The paired test of treatment - control on the panel's metric, over the seeds both arms have a value
    for."""
    control, treated = _arm_runs(runs, panel, panel.control), _arm_runs(runs, panel, treatment)
    pairs = []
    for seed in sorted(set(control) & set(treated)):
        a, b = control[seed].value(panel.metric), treated[seed].value(panel.metric)
        if a is not None and b is not None:
            pairs.append((a, b))
    cs, ts = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    try:
        return Comparison(panel, treatment, cs, ts, paired_test(ts, cs))
    except StatsError:
        why = "metric not logged by these runs" if not pairs else f"{len(pairs)} paired seed(s): needs 2"
        return Comparison(panel, treatment, cs, ts, None, why)


def all_comparisons(runs: list[PanelRun]) -> list[Comparison]:
    panels = list(dict.fromkeys(r.panel for r in runs))
    arms_run = {(r.panel.name, r.arm.name) for r in runs}
    return [compare(runs, p, arm) for p in panels for arm in p.arms[1:] if (p.name, arm.name) in arms_run]


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}g}"


def _spread(values: list[float]) -> str:
    if not values:
        return "not logged"
    if len(values) == 1:
        return _fmt(values[0])
    return f"{_fmt(statistics.fmean(values))} ± {_fmt(statistics.stdev(values), 2)}"


def comparison_rows(comparisons: list[Comparison], holm_p: dict[int, float]) -> list[str]:
    rows = [
        "| comparison | control (mean ± sd) | treatment (mean ± sd) | paired differences (seed 0, 1, ...) | "
        "mean difference | 95% CI | p | Holm p | separated |", "|" + "---|" * 9
    ]
    for c in comparisons:
        name = f"{c.treatment.label} vs {c.panel.control.label}"
        if c.test is None:
            rows.append(
                f"| {name} | {_spread(list(c.control_values))} | {_spread(list(c.treatment_values))} | "
                f"{c.why_not} | | | | | no |")
            continue
        t = c.test
        diffs = ", ".join(f"{d:+.3g}" for d in t.differences)
        rows.append(
            f"| {name} | {_spread(list(c.control_values))} | {_spread(list(c.treatment_values))} | {diffs} | "
            f"{t.mean:+.4g} | [{t.ci_low:+.4g}, {t.ci_high:+.4g}] | {t.p:.3g} | "
            f"{holm_p[id(c)]:.3g} | {'yes' if t.separated else 'no'} |")
    return rows


def secondary_rows(runs: list[PanelRun], panel: Panel) -> list[str]:
    arms = [a for a in panel.arms if _arm_runs(runs, panel, a)]
    rows = [
        "| secondary metric | " + " | ".join(a.label for a in arms) + " |", "|" + "---|" * (len(arms) + 1)
    ]
    for measure in panel.secondary:
        cells = []
        for arm in arms:
            values = [v for r in _arm_runs(runs, panel, arm).values() if (v := r.value(measure)) is not None]
            cells.append(_spread(values))
        rows.append(f"| {measure.name} | " + " | ".join(cells) + " |")
    return rows


def final_rows(runs: list[PanelRun], panel: Panel) -> list[str]:
    """The final evaluation per arm: mean@k and pass@k at each top_p (mean ± sd over seeds)."""
    arms = [a for a in panel.arms if any(r.final for r in _arm_runs(runs, panel, a).values())]
    if not arms:
        return []
    first = next(r.final for r in runs if r.panel.name == panel.name and r.final)
    head = " | ".join(f"mean@{s.k} top_p {s.top_p:g} | pass@{s.k} top_p {s.top_p:g}" for s in first)
    rows = [
        f"| final evaluation ({first[0].problems} problems) | {head} |", "|" + "---|" * (1 + 2 * len(first))
    ]
    for arm in arms:
        scored = [r.final for r in _arm_runs(runs, panel, arm).values() if r.final]
        cells = [_spread([f[i].mean for f in scored]) + " | " + _spread([f[i].pass_at_k for f in scored])
                 for i in range(len(first))]
        rows.append(f"| {arm.label} | " + " | ".join(cells) + " |")
    return rows


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def panel_section(runs: list[PanelRun], panel: Panel, comparisons: list[Comparison], holm_p: dict[int, float],
                  picture: str) -> list[str]:
    mine = [r for r in runs if r.panel.name == panel.name]
    seeds = len({r.seed for r in mine})
    cfg = mine[0].config
    updates = cfg.trainer.train_batch // cfg.trainer.mini_batch * cfg.trainer.ppo_epochs
    changes = "; ".join(f"{a.label}: `{k}` = {v}" for a in panel.arms[1:] for k, v in a.change.items())
    lines = [
        f"## {panel.title} (`{panel.name}`)", "",
        f"Mirrors the paper's {panel.figure}. Control: {panel.control.label}; {changes}. {seeds} seed(s), "
        f"{_count(cfg.trainer.total_steps, 'step')} of {cfg.trainer.train_batch} prompts x {cfg.rollout.n}, "
        f"{_count(updates, 'optimizer step')} per batch, lr {cfg.optim.lr:g}, temperature "
        f"{cfg.rollout.temperature:g}.", "",
        f"Metric, fixed before any run: **{panel.metric.name}** (`{panel.metric.key}`). "
        f"Expected: {panel.expected}.", "", *comparison_rows(comparisons, holm_p), ""
    ]
    if panel.secondary:
        lines += [*secondary_rows(runs, panel), ""]
    final = final_rows(runs, panel)
    if final:
        lines += [*final, ""]
    return lines + [f"![{panel.title}]({picture})", ""]


def write_panel_report(out: Path, runs: list[PanelRun], unavailable: dict[str, str], base: Config,
                       opts: AblateOptions) -> Path:
    """ablation.md and one panel-NAME.png per panel run."""
    comparisons = all_comparisons(runs)
    tested = [c for c in comparisons if c.test is not None]
    holm_p = dict(zip((id(c) for c in tested), holm([c.test.p for c in tested]), strict=True))
    lines = [
        "# DAPO mechanism panels", "",
        f"Task `{base.data.task}`. Each panel compares a control with treatments that change one config "
        "field, "
        "for the same seeds (a seed fixes the data order and the sampling seeds of both arms: the "
        "differences "
        "are paired). Its metric was fixed before any run (flashdapo/ablation/arms.py). Per comparison: the "
        "per-seed differences treatment - control, their mean, the 95% Student t interval, the two-sided "
        f"paired t-test p, and Holm's correction across all {len(tested)} comparisons of this report. "
        "**Separated** only where the interval excludes 0. 'Last steps' = the last "
        f"{LAST_FRACTION:.0%} of a run's steps. Secondary metrics: mean ± sd over seeds, not tested.", "",
        provenance(r.config.model.path for r in runs), ""
    ]
    for name, error in unavailable.items():
        lines += [f"Panel `{name}` was not run: {error}", ""]
    for panel in dict.fromkeys(r.panel for r in runs):
        picture = f"panel-{panel.name}.png"
        plot_panel([r for r in runs if r.panel.name == panel.name], panel.metric, out / picture)
        lines += panel_section(runs, panel, [c for c in comparisons if c.panel.name == panel.name], holm_p,
                               picture)
    wall = sum(r.wall_s for r in runs)
    lines += [
        f"Runs: {len(runs)}, training time {wall:.0f} s in all (as recorded by the process that ran each). "
        "Each run's config.yaml reruns it alone with `flashdapo train --config`.", ""
    ]
    md = out / "ablation.md"
    md.write_text("\n".join(lines))
    return md


def plot_panel(runs: list[PanelRun], measure: Measure, path: Path) -> None:
    """The panel's picture: its metric over steps (or samples), or, for one-step panels, each seed's paired
    difference from its control across the arms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if runs and all(r.config.trainer.total_steps == 1 for r in runs):
        _plot_paired_arms(ax, runs, measure)
    else:
        _plot_over_steps(ax, runs, measure, plt.get_cmap("tab10"))
    title = f"{runs[0].panel.title}: {measure.key}" if runs else measure.key
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=10)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)


def paired_by_arm(runs: list[PanelRun], measure: Measure) -> tuple[list[PanelArm], dict[int, list[float]]]:
    """The panel's arms that ran (its order) and, per seed that has them all, each arm's value of `measure`
    minus the same seed's control's (the control's own entry is 0)."""
    panel = runs[0].panel
    arms = [a for a in panel.arms if any(r.arm == a for r in runs)]
    by_seed: dict[int, dict[PanelArm, float]] = {}
    for r in runs:
        value = r.value(measure)
        if value is not None:
            by_seed.setdefault(r.seed, {})[r.arm] = value
    return arms, {
        seed: [values[a] - values[panel.control] for a in arms]
        for seed, values in sorted(by_seed.items())
        if panel.control in values and all(a in values for a in arms)
    }


def _plot_paired_arms(ax, runs: list[PanelRun], measure: Measure) -> None:
    """One-step panels (a curve over steps would be a single point): each seed's metric minus its own
    control's, across the arms in the panel's order (a thin line per seed), and the mean over seeds
    (thick)."""
    arms, paired = paired_by_arm(runs, measure)
    xs = list(range(len(arms)))
    for ys in paired.values():
        ax.plot(xs, ys, color="tab:blue", linewidth=0.7, alpha=0.4)
    if paired:
        mean = [statistics.fmean(ys[i] for ys in paired.values()) for i in xs]
        ax.plot(xs, mean, color="tab:blue", linewidth=2.4, marker="o", label=f"mean of {len(paired)} seeds")
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xticks(xs, [a.label for a in arms], fontsize=8)
    ax.set_ylabel(f"{measure.key} minus the control's (same seed)")


def _plot_over_steps(ax, runs: list[PanelRun], measure: Measure, colours) -> None:
    """The metric's key against its x (step or samples): each seed a thin line, each arm's mean a thick
    one."""
    for index, arm in enumerate(dict.fromkeys(r.arm for r in runs)):
        curves = [_curve(r.history, measure) for r in runs if r.arm == arm]
        for xs, ys in curves:
            ax.plot(xs, ys, color=colours(index), linewidth=0.7, alpha=0.45)
        xs, ys = _mean_curve(curves)
        if xs:
            ax.plot(xs, ys, color=colours(index), linewidth=2.4, label=f"{arm.label} (mean of {len(curves)})")
    if measure.x == "step" and runs and "last steps" in measure.name:
        total = runs[0].config.trainer.total_steps
        ax.axvspan(total - last_steps(runs[0].config) + 0.5, total + 0.5, color="grey", alpha=0.12,
                   label="the metric's last steps")
    ax.set_xlabel("samples generated" if measure.x != "step" else "step")
    ax.set_ylabel(measure.key)


def _curve(history: list[dict], measure: Measure) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for m in history:
        if measure.key not in m:
            continue
        x = m.get(measure.x, 0.0 if m.get("step", 0) == 0 else None)
        if x is not None:
            xs.append(float(x))
            ys.append(float(m[measure.key]))
    return xs, ys


def _mean_curve(curves: list[tuple[list[float], list[float]]]) -> tuple[list[float], list[float]]:
    """Mean over the seeds at each x every seed has (steps line up; samples counters generally do not: then
    the mean at each seed's i-th point)."""
    curves = [c for c in curves if c[0]]
    if not curves:
        return [], []
    length = min(len(xs) for xs, _ in curves)
    xs = [statistics.fmean(c[0][i] for c in curves) for i in range(length)]
    ys = [statistics.fmean(c[1][i] for c in curves) for i in range(length)]
    return xs, ys

"""The ladder's report: ablation.md (the table beside the paper's Table 1) and ablation.png (the training
dynamics of the paper's Figs. 2, 4, 5 and 6, one colour per arm, mean over seeds)."""

from __future__ import annotations

import statistics
from pathlib import Path

from ..config import Config
from ..tasks import task_num_val
from .arms import ARMS
from .base import BaseStatistics, provenance
from .records import ArmRun, samples_generated

MEAN, PASS = "val/acc/mean@k", "val/acc/pass@k"

PANELS = (
    ("validation mean@k", MEAN),
    ("entropy", "actor/entropy"),
    ("response length (trained)", "response_length/mean"),
    ("tokens clipped (either side)", "actor/pg_clipfrac"),
    ("truncated fraction (generated)", "train/gen_truncated"),
    ("groups kept by dynamic sampling", "train/kept_fraction"),
)
"""(panel title, metric) of ablation.png."""


def _values(run: ArmRun, key: str) -> list[float]:
    return [m[key] for m in run.history if key in m]


def mean_std(values: list[float]) -> str:
    """'m ± s' over seeds (sample std); 'm' alone for one seed."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def _by_arm(runs: list[ArmRun]) -> list[tuple[str, list[ArmRun]]]:
    order = [a.name for a in ARMS]
    names = sorted({r.arm.name for r in runs}, key=order.index)
    return [(n, [r for r in runs if r.arm.name == n]) for n in names]


def table(runs: list[ArmRun]) -> list[str]:
    """The Markdown table: per arm, the paper's number and the measured ones (mean ± std over seeds)."""
    k = runs[0].config.rollout.val_n
    head = (f"| arm | paper: AIME 2024 avg@32 | seeds | final mean@{k} | best mean@{k} | final pass@{k} | "
            f"best pass@{k} | samples generated | wall time per seed (s) |")
    rows = [head, "|" + "---|" * 9]
    for _, group in _by_arm(runs):
        arm = group[0].arm
        if not all(_values(r, MEAN) for r in group):  # no validation set, or validation off
            rows.append(f"| {arm.label} | {arm.paper_aime} | {len(group)} | no validation |" + " |" * 5)
            continue
        finals = [_values(r, MEAN)[-1] for r in group]
        bests = [max(_values(r, MEAN)) for r in group]
        pass_final = [_values(r, PASS)[-1] for r in group]
        pass_best = [max(_values(r, PASS)) for r in group]
        samples = statistics.mean(samples_generated(r) for r in group)
        wall = statistics.mean(r.wall_s for r in group)
        rows.append(
            f"| {arm.label} | {arm.paper_aime} | {len(group)} | {mean_std(finals)} | {mean_std(bests)} | "
            f"{mean_std(pass_final)} | {mean_std(pass_best)} | {samples:,.0f} | {wall:.0f} |")
    return rows


def write_report(out: Path, runs: list[ArmRun], base_stats: BaseStatistics,
                 base: Config) -> tuple[Path, Path]:
    """ablation.md and ablation.png in `out`."""
    tc, rc = base.trainer, base.rollout
    val_steps = sorted({int(m["step"]) for m in runs[0].history if MEAN in m})
    lines = [
        "# DAPO ablation ladder", "",
        f"Task `{base.data.task}`, {tc.total_steps} steps of {tc.train_batch} prompts x {rc.n} responses "
        f"(dynamic sampling: generation batch {tc.gen_batch}), response limit {rc.max_response_length} "
        "tokens; "
        f"validation on {task_num_val(base.data)} "
        f"held-out problems, {rc.val_n} samples each at temperature {rc.val_temperature}, top_p "
        f"{rc.val_top_p}, "
        f"at steps {', '.join(map(str, val_steps))}. Best = the highest of those validations (step 0, the "
        "base, "
        "included). The paper's column is Qwen2.5-32B on AIME 2024 (Table 1): a different model, task and "
        "scale; "
        "compare directions, not values.", "", *table(runs), "",
        "Base model before RL, sampled at the training settings on the training prompts: "
        f"{base_stats.summary()}.",
        "",
        provenance(r.config.model.path
                   for r in runs), "", "Arms' settings and the command that reruns each alone: arms.md.", "",
        "![training dynamics per arm](ablation.png)", ""
    ]
    md = out / "ablation.md"
    md.write_text("\n".join(lines))
    png = out / "ablation.png"
    plot_ladder(runs, png)
    return md, png


def _mean_curve(group: list[ArmRun], key: str) -> tuple[list[float], list[float]]:
    by_step: dict[float, list[float]] = {}
    for run in group:
        for m in run.history:
            if key in m:
                by_step.setdefault(m["step"], []).append(m[key])
    steps = sorted(by_step)
    return steps, [statistics.mean(by_step[s]) for s in steps]


def _smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1):i + 1]
        out.append(sum(part) / len(part))
    return out


def plot_ladder(runs: list[ArmRun], path: Path, smooth: int = 5) -> None:
    """One panel per PANELS entry, one colour per arm; training curves are a trailing mean over `smooth`
    steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    colours = plt.get_cmap("tab10")
    for index, (_, group) in enumerate(_by_arm(runs)):
        arm = group[0].arm
        for ax, (title, key) in zip(axes.flat, PANELS):
            steps, values = _mean_curve(group, key)
            if not steps:
                continue
            validation = key == MEAN
            ax.plot(steps, values if validation else _smooth(values, smooth), color=colours(index),
                    marker="o" if validation else None, markersize=3, label=arm.label)
            ax.set_title(title)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    seeds = max(len(g) for _, g in _by_arm(runs))
    fig.suptitle(
        f"DAPO ablation ladder: mean over {seeds} seed(s); training curves smoothed over {smooth} steps")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)

"""The panels' report from synthetic metrics histories (the keys the trainer logs), and a tiny `ablate --quick`
end to end."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch

from flashdapo.ablation.arms import PANELS, panel_by_name
from flashdapo.ablation.base import weights_digest
from flashdapo.ablation.command import parse_ablate_command
from flashdapo.ablation.options import AblateOptions
from flashdapo.ablation.panel_report import all_comparisons, paired_by_arm, plot_panel, write_panel_report
from flashdapo.ablation.panel_runner import plan_panels, run_panels
from flashdapo.ablation.records import PanelRun
from flashdapo.ablation.runner import AblationError
from flashdapo.ablation.stats import holm, paired_test
from flashdapo.config import merge, preset
from tests.helpers.ablation import TINY_BASE

BASE = preset("scratchpad")
CFG = merge(BASE, {"trainer": {"total_steps": 8, "ppo_epochs": 4}})
KEYS = {"clip-higher-random": "actor/entropy", "overlong": "response_length/clip_ratio"}
SHIFT = {"clip-0.20": 0.0, "clip-0.28": 0.05, "clip-0.35": 0.1, "none": 0.0, "filter": 0.04, "soft": -0.01}


def _history(panel: str, arm: str, seed: int) -> list[dict]:
    """Synthetic: the metric's key drifts with the step, offset per seed and per arm (SHIFT), with the logged
    secondary keys; the soft arm's shift is swamped by seed noise."""
    key = KEYS[panel]
    noise = [0.0, 0.03, -0.02, 0.01, -0.015][seed] * (4 if arm == "soft" else 0.2)
    rows = [{"step": 0, "val/acc/mean@k": 0.2}]
    for step in range(1, 9):
        rows.append({"step": step, key: 0.5 - 0.01 * step + 0.1 * seed + SHIFT[arm] + noise,
                     "actor/clipfrac_upper": 0.02 + SHIFT[arm] / 10, "actor/upclip_old_prob": 0.6,
                     "train/gen_truncated": 0.1, "train/gen_acc": 0.3})
    return rows


def _runs(seeds: int = 5) -> list[PanelRun]:
    runs = []
    for name in KEYS:
        panel = panel_by_name(name)
        for arm in panel.arms:
            for seed in range(seeds):
                runs.append(PanelRun(panel, arm, seed, CFG, _history(name, arm.name, seed), 10.0))
    return runs


def _expected(panel: str, arm: str, seeds: int = 5):
    def last(a, s):  # A': the mean over the run's steps; overlong: over its last quarter (2 of 8 steps)
        rows = _history(panel, a, s)[1:] if panel == "clip-higher-random" else _history(panel, a, s)[-2:]
        return sum(r[KEYS[panel]] for r in rows) / len(rows)
    control = panel_by_name(panel).control.name
    return paired_test([last(arm, s) for s in range(seeds)], [last(control, s) for s in range(seeds)])


def test_report_tables_from_synthetic_histories(tmp_path):
    runs = _runs()
    md = write_panel_report(tmp_path, runs, {"clip-higher-task": "logging: unknown key(s) ['probe_every']"}, BASE,
                            AblateOptions(out=str(tmp_path)))
    text = md.read_text()
    comparisons = all_comparisons(runs)
    assert [(c.panel.name, c.treatment.name) for c in comparisons] == [
        ("clip-higher-random", "clip-0.28"), ("clip-higher-random", "clip-0.35"), ("overlong", "filter"),
        ("overlong", "soft")]
    holm_p = holm([c.test.p for c in comparisons])
    for c, adjusted in zip(comparisons, holm_p, strict=True):
        want = _expected(c.panel.name, c.treatment.name)
        assert c.test.mean == pytest.approx(want.mean) and c.test.p == pytest.approx(want.p)
        row = next(line for line in text.splitlines() if line.startswith(f"| {c.treatment.label} vs "))
        assert f"{want.mean:+.4g}" in row and f"[{want.ci_low:+.4g}, {want.ci_high:+.4g}]" in row
        assert f"| {want.p:.3g} | {adjusted:.3g} |" in row
        assert row.endswith("| yes |" if want.separated else "| no |")
    assert [c.test.separated for c in comparisons] == [True, True, True, False]
    assert "Fig. 2" in text and "Fig. 5" in text and "Panel `clip-higher-task` was not run" in text
    # 16 prompts in mini-batches of 4, 4 epochs: 16 optimizer steps a batch
    assert "8 steps of 16 prompts x 8, 16 optimizer steps per batch, lr 0.0003, temperature 1." in text
    assert "| up-clipped token fraction | 0.02 ± 0 | 0.025 ± 0 | 0.03 ± 0 |" in text
    for name in KEYS:
        assert (tmp_path / f"panel-{name}.png").stat().st_size > 5000 and f"(panel-{name}.png)" in text


def test_one_step_panels_are_drawn_as_paired_differences_across_arms(tmp_path):
    panel = panel_by_name("clip-higher-random")
    one_step = merge(BASE, {"trainer": {"total_steps": 1}})
    values = {("clip-0.20", 0): 0.60, ("clip-0.28", 0): 0.61, ("clip-0.35", 0): 0.63,
              ("clip-0.20", 1): 0.70, ("clip-0.28", 1): 0.70, ("clip-0.35", 1): 0.69,
              ("clip-0.20", 2): 0.50, ("clip-0.28", 2): 0.52}  # seed 2 lacks an arm: left out
    runs = [PanelRun(panel, arm, seed, one_step, [{"step": 1, "actor/entropy": values[arm.name, seed]}], 1.0)
            for arm in panel.arms for seed in range(3) if (arm.name, seed) in values]
    arms, paired = paired_by_arm(runs, panel.metric)
    assert [a.name for a in arms] == ["clip-0.20", "clip-0.28", "clip-0.35"] and sorted(paired) == [0, 1]
    assert paired[0] == pytest.approx([0.0, 0.01, 0.03]) and paired[1] == pytest.approx([0.0, 0.0, -0.01])
    plot_panel(runs, panel.metric, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 5000


def test_a_metric_not_logged_is_said_not_tested(tmp_path):
    panel = panel_by_name("dynamic-sampling")
    runs = [PanelRun(panel, arm, s, CFG, [{"step": 0, "val/acc/mean@k": 0.2}, {"step": 8, "val/acc/mean@k": 0.5}],
                     1.0) for arm in panel.arms for s in range(2)]
    text = write_panel_report(tmp_path, runs, {}, BASE, AblateOptions(out=str(tmp_path))).read_text()
    assert "| metric not logged by these runs | | | | | no |" in text


# The ladder tests' tiny sizes, with a batch that one generation round fills.
TINY = {**TINY_BASE, "trainer": {"total_steps": 3, "train_batch": 4, "gen_batch": 4, "mini_batch": 2}}


def test_quick_and_ladder_stand_alone_or_take_a_value(tmp_path):
    assert parse_ablate_command(["--quick", "--out", str(tmp_path)])[0].quick
    assert not parse_ablate_command(["--quick", "False"])[0].quick
    opts = parse_ablate_command(["--ladder", "--arms", "naive-grpo"])[0]
    assert opts.ladder and opts.arms == ["naive-grpo"] and not opts.quick
    assert parse_ablate_command(["--trainer.total-steps", "3", "--ladder"])[0].ladder


def test_command_line_fields_win_over_the_panels_but_not_the_varied_one(tmp_path):
    opts, cfg, start = parse_ablate_command(["--out", str(tmp_path), "--panels", "overlong",
                                             "--trainer.total-steps", "7"])
    plan = plan_panels(cfg, opts, start)
    assert {r.config.trainer.total_steps for r in plan.runs} == {7} and len(plan.runs) == 3 * 5
    assert {r.seed for r in plan.runs} == set(range(5))
    by_seed = {}
    for r in plan.runs:  # arms of a seed: the same seed, hence data order and sampling streams
        by_seed.setdefault(r.seed, set()).add(r.config.trainer.seed)
    assert all(s == {seed} for seed, s in by_seed.items())
    opts, cfg, start = parse_ablate_command(["--out", str(tmp_path), "--panels", "overlong",
                                             "--algorithm.overlong-filter", "True"])
    with pytest.raises(AblationError, match="varies this field"):
        plan_panels(cfg, opts, start)


@pytest.mark.slow
def test_tiny_quick_end_to_end(tmp_path, capsys):
    base = merge(BASE, TINY)
    opts = AblateOptions(out=str(tmp_path), quick=True, seeds=2)
    runs = run_panels(base, opts, start=BASE)
    printed = capsys.readouterr().out
    expected = [(p.name, a) for p in PANELS if p.quick_arms for a in p.quick_arms]
    got = sorted({(r.panel.name, r.arm.name) for r in runs})
    # Every quick arm runs, but the random-reward Clip-Higher ones where this build lacks the random verifier.
    assert set(got) <= set(expected) and {a for p, a in got if p == "overlong"} == {"none", "filter", "soft"}
    assert len(got) == len(expected) or "panel clip-higher-random not run" in printed
    assert len(runs) == 2 * len(got) and not any(r.skipped for r in runs)
    for r in runs:
        rows = [json.loads(line) for line in
                (tmp_path / "panels" / r.panel.name / r.arm.name / f"seed{r.seed}" / "metrics.jsonl").read_text()
                .splitlines()]
        assert [row["step"] for row in rows if "response_length/clip_ratio" in row] == [1, 2, 3]
    text = (tmp_path / "ablation.md").read_text()
    assert re.search(r"\| overlong filtering vs no overlong handling \| [0-9.]", text), text
    assert (tmp_path / "panel-overlong.png").is_file()
    assert printed.count("ablation: [") == len(runs)
    # A rerun skips every finished run and writes the same report.
    again = run_panels(base, opts, start=BASE)
    assert all(r.skipped for r in again) and [r.history for r in again] == [r.history for r in runs]
    assert (tmp_path / "ablation.md").read_text().split("Runs:")[0] == text.split("Runs:")[0]


@pytest.mark.slow
def test_tiny_dynamic_sampling_panel_with_its_final_evaluation(tmp_path):
    base = merge(BASE, TINY)
    opts = AblateOptions(out=str(tmp_path), panels=["dynamic-sampling"], seeds=2, final_eval_k=2)
    runs = run_panels(base, opts, start=BASE)
    assert [(r.arm.name, r.seed) for r in runs] == [("off", 0), ("off", 1), ("on", 0), ("on", 1)]
    assert [r.config.algorithm.dynamic_sampling for r in runs] == [False, False, True, True]
    files = [tmp_path / "panels" / "dynamic-sampling" / r.arm.name / f"seed{r.seed}" / "final_eval.json" for r in runs]
    for run, path in zip(runs, files, strict=True):
        scores = json.loads(path.read_text())["scores"]
        assert [(s["top_p"], s["k"], s["problems"]) for s in scores] == [(1.0, 2, 4), (0.7, 2, 4)]
        assert [(f.mean, f.pass_at_k) for f in run.final] == [(s["mean"], s["pass_at_k"]) for s in scores]
        assert all(0 <= s["mean"] <= s["pass_at_k"] <= 1 for s in scores)
    assert "| final evaluation (4 problems) | mean@2 top_p 1 | pass@2 top_p 1 | mean@2 top_p 0.7 |" in \
        (tmp_path / "ablation.md").read_text()
    stamps = [p.stat().st_mtime_ns for p in files]
    again = run_panels(base, opts, start=BASE)  # finished: neither trained nor evaluated again
    assert all(r.skipped for r in again) and [p.stat().st_mtime_ns for p in files] == stamps
    assert [r.final for r in again] == [r.final for r in runs]


def test_the_panels_are_the_default_and_ladder_runs_the_ladder(monkeypatch):
    import flashdapo.ablation.command as command

    called = []
    monkeypatch.setattr(command, "run_panels", lambda cfg, opts, log, start: called.append("panels"))
    monkeypatch.setattr(command, "run_ablation", lambda cfg, opts, log: called.append("ladder"))
    command.ablate_main(["--out", "unused"])
    command.ablate_main(["--ladder", "--out", "unused"])
    assert called == ["panels", "ladder"]


def test_quick_and_default_share_bases_and_runs(tmp_path):
    quick = plan_panels(BASE, AblateOptions(out=str(tmp_path), quick=True, seeds=5))
    full = plan_panels(BASE, AblateOptions(out=str(tmp_path), seeds=5))
    configs = {(r.panel.name, r.arm.name, r.seed): r.config for r in full.runs}
    assert quick.runs and all(configs[(r.panel.name, r.arm.name, r.seed)] == r.config for r in quick.runs)
    assert set(quick.bases) <= set(full.bases)
    # the token-level panel's task setting differs: its own base; the others share one
    assert len(full.bases) == 2


def test_report_names_each_base_by_its_weights_and_the_machine(tmp_path):
    base_dir = tmp_path / "base-abc"
    base_dir.mkdir()
    (base_dir / "model.safetensors").write_bytes(b"weights")
    (base_dir / "config.json").write_text("{}")  # not weights: not in the digest
    digest = weights_digest(base_dir)
    assert digest == hashlib.sha256(b"weights").hexdigest()[:12]
    (base_dir / "config.json").write_text('{"a": 1}')
    assert weights_digest(base_dir) == digest
    (base_dir / "model.safetensors").write_bytes(b"weightz")
    assert weights_digest(base_dir) != digest
    cfg = merge(CFG, {"model": {"path": str(base_dir)}})
    runs = [PanelRun(r.panel, r.arm, r.seed, cfg, r.history, r.wall_s) for r in _runs()]
    text = write_panel_report(tmp_path, runs, {}, BASE, AblateOptions(out=str(tmp_path))).read_text()
    line = next(x for x in text.splitlines() if x.startswith("Base model(s):"))
    assert f"`base-abc` (weights sha256 {weights_digest(base_dir)})" in line
    assert f"torch {torch.__version__}" in line and "CPUs" in line

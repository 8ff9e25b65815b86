"""`flashdapo ablate` does what it is asked or says why not: --arms (the ladder's) without --ladder and --panels
with --ladder or --quick, --quick with --ladder, and an --out that is a file are refused in one line before
anything runs, and a rerun with other panels keeps the
earlier panels' sections in ablation.md (read back from their finished runs, nothing rerun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashdapo.__main__ import main
from flashdapo.ablation import command, panel_report, panel_runner
from flashdapo.ablation.options import AblateOptions
from flashdapo.config import merge, preset
from tests.helpers.ablation import TINY_BASE


@pytest.fixture
def nothing_runs(monkeypatch):
    """Record a run of the panels or the ladder instead of starting it (minutes of CPU)."""
    started = []
    monkeypatch.setattr(command, "run_panels", lambda *a, **k: started.append("panels") or [])
    monkeypatch.setattr(command, "run_ablation", lambda *a, **k: started.append("ladder") or [])
    return started


@pytest.mark.parametrize(("flags", "message"), [
    (["--arms", "naive-grpo"], "ablate.arms: --arms chooses the rungs of the ladder and needs --ladder; the panels "
                               "are chosen with --panels NAME ..."),
    (["--arms=naive-grpo", "--quick"], "ablate.arms: --arms chooses the rungs of the ladder and needs --ladder"),
    (["--ladder", "--panels", "overlong"], "ablate.panels: --panels chooses the mechanism panels, but --ladder runs "
                                           "the ladder's rungs (choose them with --arms); drop one of them"),
    (["--quick", "--panels", "overlong"], "ablate.panels: --panels chooses the mechanism panels, but --quick runs "
                                          "its own panels and arms; drop one of them"),
    (["--ladder", "--quick"], "ablate.quick: --quick runs the short panels and --ladder the whole ladder (it has no "
                              "short variant"),
    (["--out", "FILE"], "ablate.out: FILE is a file; the ablation writes its runs and report under a directory"),
])
def test_an_option_the_mode_would_ignore_is_refused_before_anything_runs(flags, message, tmp_path, capsys,
                                                                         nothing_runs):
    (tmp_path / "FILE").write_text("an earlier report\n")
    flags = [str(tmp_path / f) if f == "FILE" else f for f in flags]
    message = message.replace("FILE", str(tmp_path / "FILE"))
    assert main(["ablate", "--out", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flashdapo: config error: {message}") and err.count("\n") == 1, err
    assert nothing_runs == []


def test_the_options_of_the_mode_chosen_still_run(tmp_path, capsys, nothing_runs):
    assert main(["ablate", "--out", str(tmp_path), "--ladder", "--arms", "naive-grpo"]) == 0
    assert main(["ablate", "--out", str(tmp_path), "--panels", "overlong"]) == 0
    assert main(["ablate", "--out", str(tmp_path), "--quick"]) == 0
    assert nothing_runs == ["ladder", "panels", "panels"]


def _fake_training(monkeypatch):
    """Panels without training: a run 'finishes' by writing its arm.json (with a history of one step), as
    train_or_reuse does; bases and final evaluations are skipped."""
    trained = []

    def train_or_reuse(cfg, name, seed):
        marker = Path(cfg.logging.run_dir) / "arm.json"
        if marker.is_file():
            done = json.loads(marker.read_text())
            return done["history"], done["wall_s"], True
        trained.append(name)
        history = [{"step": 1, "response_length/clip_ratio": 0.1 + 0.01 * seed, "actor/entropy": 0.5}]
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"arm": name, "seed": seed, "wall_s": 1.0, "config": cfg.to_dict(),
                                      "history": history}))
        return history, 1.0, False

    monkeypatch.setattr(panel_runner, "train_or_reuse", train_or_reuse)
    monkeypatch.setattr(panel_runner, "build_base", lambda *a, **k: False)
    monkeypatch.setattr(panel_runner, "final_evaluation", lambda cfg, k: [])
    monkeypatch.setattr(panel_report, "provenance", lambda paths: "Base model(s): faked.")
    return trained


def test_a_rerun_with_another_panel_keeps_the_earlier_panels_section(tmp_path, monkeypatch):
    trained = _fake_training(monkeypatch)
    base = merge(preset("scratchpad"), TINY_BASE)
    lines = []
    first = AblateOptions(out=str(tmp_path), panels=["overlong"], seeds=2, final_eval_k=0)
    panel_runner.run_panels(base, first, log=lines.append)
    assert len(trained) == 3 * 2
    second = AblateOptions(out=str(tmp_path), panels=["clip-higher-task"], seeds=2, final_eval_k=0)
    panel_runner.run_panels(base, second, log=lines.append)
    assert len(trained) == 3 * 2 + 2 * 2  # the overlong runs were read back, not rerun
    report = (tmp_path / "ablation.md").read_text()
    assert "(`clip-higher-task`)" in report and "(`overlong`)" in report, report
    assert "ablation: the report keeps 6 finished run(s) of other panels in" in "\n".join(lines)
    # Run again, the first panel: the second's section is kept in turn.
    panel_runner.run_panels(base, first, log=lines.append)
    report = (tmp_path / "ablation.md").read_text()
    assert "(`clip-higher-task`)" in report and "(`overlong`)" in report and len(trained) == 10

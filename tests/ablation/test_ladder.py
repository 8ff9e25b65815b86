"""`flashdapo ablate`, CI-sized: two arms, one seed, a few steps on a tiny base; files, settings, rerun skips."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flashdapo.ablation.arms import ARMS, arm_index
from flashdapo.ablation.command import parse_ablate_args
from flashdapo.ablation.runner import AblationError, run_ablation
from flashdapo.config import load_file, merge
from flashdapo.config import preset as named_preset
from tests.helpers.ablation import TINY_BASE

ARMS_RUN = ["token-level-loss", "dynamic-sampling"]


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_parse_splits_ablate_options_from_train_options(tmp_path):
    opts, cfg = parse_ablate_args(["--out", str(tmp_path), "--seeds", "2", "--arms", "clip-higher", "naive-grpo",
                                   "--trainer.total-steps", "7"])
    assert (opts.out, opts.seeds, opts.arms) == (str(tmp_path), 2, ["clip-higher", "naive-grpo"])
    assert cfg.trainer.total_steps == 7 and cfg.data.task == "scratchpad"  # the ablation's default preset


def test_smoke_two_arms_one_seed(tmp_path, capsys):
    base = merge(named_preset("scratchpad"), TINY_BASE)
    opts, _ = parse_ablate_args(["--out", str(tmp_path), "--seeds", "1", "--arms", *ARMS_RUN,
                                 "--base-probe-prompts", "4"])
    runs = run_ablation(base, opts)
    printed = capsys.readouterr().out
    assert [r.arm.name for r in runs] == ARMS_RUN and not any(r.skipped for r in runs)
    for name in ("ablation.md", "ablation.png", "arms.md", "base/config.json", "base/tokenizer.json",
                 "base_statistics.json"):
        assert (tmp_path / name).is_file(), name
    assert printed.count("ablation: [") == 2  # one progress line per (arm, seed)
    report = (tmp_path / "ablation.md").read_text()
    for name in ARMS_RUN:
        arm = ARMS[arm_index(name)]
        assert f"| {arm.label} | {arm.paper_aime} | 1 |" in report
        run_dir = tmp_path / "arms" / name / "seed0"
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2]
        # The written config reruns the arm alone: it loads back to exactly the config the arm ran with.
        assert load_file(run_dir / "config.yaml", named_preset("scratchpad")) == runs[ARMS_RUN.index(name)].config
    assert "flashdapo train --config" in (tmp_path / "arms.md").read_text()

    # Each arm differs from the one before in exactly the technique added (and the run directory).
    before, after = (_flat(r.config.to_dict()) for r in runs)
    changed = {k for k in after if after[k] != before[k]} - {"logging.run_dir"}
    assert changed == set(ARMS[arm_index(ARMS_RUN[1])].adds) == {"algorithm.dynamic_sampling", "trainer.gen_batch"}
    assert runs[0].config.model.path == runs[1].config.model.path == str((tmp_path / "base").resolve())
    dynamic = [r for r in runs[1].history if r["step"] > 0]
    assert all(r["train/num_gen_batches"] >= 1 for r in dynamic)

    # A rerun skips the finished arms, and changes nothing on disk.
    metrics = {n: (tmp_path / "arms" / n / "seed0" / "metrics.jsonl").read_text() for n in ARMS_RUN}
    again = run_ablation(base, opts)
    assert all(r.skipped for r in again) and [r.history for r in again] == [r.history for r in runs]
    assert "reusing" in capsys.readouterr().out
    assert metrics == {n: (tmp_path / "arms" / n / "seed0" / "metrics.jsonl").read_text() for n in ARMS_RUN}

    # A rerun of one arm keeps the other's finished row in the report.
    report = (tmp_path / "ablation.md").read_text()
    one = run_ablation(base, dataclasses.replace(opts, arms=ARMS_RUN[:1]))
    assert [r.arm.name for r in one] == ARMS_RUN[:1] and one[0].skipped
    assert "the report keeps 1 finished run(s) of other arms" in capsys.readouterr().out
    assert (tmp_path / "ablation.md").read_text() == report

    # A different ladder in the same OUT is refused, not mixed in.
    with pytest.raises(AblationError, match="different config"):
        run_ablation(merge(base, {"trainer": {"total_steps": 3}}), opts)

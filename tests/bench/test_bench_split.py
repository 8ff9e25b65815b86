"""bench/bench_split.py: the co-located arm end to end (smoke), the split metrics it reads, and the one line
it prints where split placement is not built."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `bench` is a top-level folder, not installed

from bench import bench_split  # noqa: E402


def _record(step: int, **extra) -> dict:
    return {"step": step, "timing_s/step": 2.0 * step, "timing_s/gen": 0.5 * step, "train/kept_groups": 4.0, **extra}


def test_colocated_idle_fractions_come_from_the_gen_share_of_each_step():
    r = bench_split.summarize([_record(1), _record(2), _record(3)], colocated=True)
    assert r.s_per_step == 5.0  # steps 2.. only
    assert r.trainer_idle == 0.25 and r.rollout_idle == 0.75 and r.lag_max == 0
    assert math.isnan(r.weight_broadcast_s)


def test_split_runs_read_the_split_metrics():
    split = {"split/trainer_idle": 0.1, "split/rollout_idle": 0.3, "split/lag_mean": 1.0,
             "split/lag_max": 1.0, "split/weight_push_s": 0.02, "split/weight_push_bytes": 4e5,
             "split/batch_transfer_s": 0.001}
    r = bench_split.summarize([_record(1, **{**split, "split/lag_max": 0.0, "split/lag_mean": 0.0}),
                               _record(2, **split), _record(3, **split)], colocated=False)
    assert (r.trainer_idle, r.rollout_idle, r.lag_max, r.weight_broadcast_bytes) == (0.1, 0.3, 1.0, 4e5)
    assert r.lag_mean == 2 / 3  # every step, the first included


def test_the_table_pairs_each_arm_with_its_colocated_repeat():
    col = [bench_split.summarize([_record(1), _record(2)], True)] * 2
    fast = [bench_split.ArmResult(2.0, 0.1, 0.2, 1.0, 1.0, 0.01, 1e5, 0.001, 4.0)] * 2
    results = {("toy", "colocated"): col, ("toy", "split-k1"): fast}
    lines = bench_split.table(results, ["toy"], ["colocated", "split-k1"])
    rows = [line.split(" | ") for line in lines[2:]]
    assert rows[0][3].startswith("1.000 ") and rows[1][3].startswith("0.500 ")


@pytest.mark.slow
def test_smoke_runs_the_colocated_arm_and_writes_its_table(tmp_path, capsys):
    args = ["--smoke", "--arms", "colocated", "--work", str(tmp_path / "work"), "--out", str(tmp_path)]
    assert bench_split.main(args) == 0
    (report,) = tmp_path.glob("*-split-smoke.md")
    (row,) = [line.split(" | ") for line in report.read_text().splitlines() if line.startswith("| toy |")]
    assert row[1] == "colocated" and float(row[2]) > 0 and row[3] == "1.000"
    assert 0 < float(row[4]) < 1 and float(row[4]) + float(row[5]) == pytest.approx(1.0)


def test_split_arms_without_split_placement_are_named_in_one_line(tmp_path, capsys):
    if bench_split.split_supported():
        return  # the feature has landed: the split arms run (covered by the bench itself)
    assert bench_split.main(["--arms", "split-k0,split-k1", "--work", str(tmp_path), "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().out.strip().count("\n") == 0 and not list(tmp_path.iterdir())

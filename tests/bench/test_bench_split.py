"""bench/bench_split.py: the figures it reads from step records, its table, the arms run_all builds (each
split arm on 1 + 1 ranks with its lag, the order rotating between repeats), the co-located and a split arm
end to end (smoke), and the one line it prints where split placement is not built."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `bench` is a top-level folder, not installed

from bench import bench_longtail, bench_split  # noqa: E402


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


SPLIT = {"split/trainer_idle": 0.1, "split/rollout_idle": 0.3, "split/lag_mean": 1.0, "split/lag_max": 1.0,
         "split/weight_push_s": 0.02, "split/weight_push_bytes": 4e5, "split/batch_transfer_s": 0.001}


def test_run_all_runs_each_split_arm_on_two_ranks_with_its_lag_in_rotating_order(tmp_path, monkeypatch):
    """The arms run_all builds, the trainer stubbed by recorded step records: the split arms on 1 trainer + 1
    rollout rank with their --rollout.max-lag, the co-located arm on the ranks asked for, one thread per
    process, seed = repeat, a run directory per (arm, repeat); each result summarized as its placement says."""
    assert bench_split.split_supported(), "no rollout.placement: the bench would drop every split arm"
    calls = []

    def recorded_run(cfg, ranks, in_process, timeout, preset, flags, env, bench):
        calls.append((cfg.logging.run_dir, cfg.trainer.seed, ranks, flags, env, preset, bench, in_process))
        split = {**SPLIT, "timing_s/step": 1.0} if flags else {}  # split steps twice as fast as co-located
        return [_record(s, **split) for s in (1, 2, 3)]

    monkeypatch.setattr(bench_longtail, "run_arm", recorded_run)  # bench_split.run_arm's trainer run
    arms = list(bench_split.ARMS)
    results = bench_split.run_all({"toy": bench_split.workload("toy", smoke=True)}, arms, repeats=2, ranks=1,
                                  work=tmp_path, in_process=True, timeout=60, log=lambda line: None)
    order = ["colocated", "split-k0", "split-k1", "split-k0", "split-k1", "colocated"]
    assert [(Path(c[0]).name, c[1]) for c in calls] == [(f"toy-{arm}-r{i // 3}", i // 3)
                                                          for i, arm in enumerate(order)]
    assert all(Path(c[0]).parent == tmp_path / "runs" for c in calls)
    for (_, _, ranks, flags, env, preset, bench, in_process), arm in zip(calls, order, strict=True):
        lag = {"colocated": None, "split-k0": "0", "split-k1": "1"}[arm]
        assert (ranks, flags) == ((1, ()) if lag is None else (2, ("--rollout.placement", "split",
                                                                  "--rollout.rollout-ranks", "1",
                                                                  "--rollout.max-lag", lag))), arm
        assert (env, preset, bench, in_process) == ({"OMP_NUM_THREADS": "1"}, "toy", "bench_split", True)
    assert [len(results[("toy", arm)]) for arm in arms] == [2, 2, 2]
    colocated, split = results[("toy", "colocated")][0], results[("toy", "split-k1")][0]
    assert (colocated.trainer_idle, colocated.rollout_idle, colocated.lag_max) == (0.25, 0.75, 0.0)
    assert (split.trainer_idle, split.rollout_idle, split.lag_max, split.weight_broadcast_bytes) == \
        (0.1, 0.3, 1.0, 4e5)
    rows = [line.split(" | ") for line in bench_split.table(results, ["toy"], arms)[2:]]
    ratios = [(r[1], r[3]) for r in rows]  # paired with the same repeat's co-located run: median [min, max]
    assert ratios == [("colocated", "1.000 [1.000, 1.000]"), ("split-k0", "0.200 [0.200, 0.200]"),
                      ("split-k1", "0.200 [0.200, 0.200]")]


@pytest.mark.slow
@pytest.mark.distributed
def test_smoke_runs_a_split_arm_and_reads_the_trainers_split_metrics(tmp_path):
    """A split arm for real (k = 1, 1 trainer + 1 rollout rank under torchrun, 2 steps): every split column
    holds a figure the trainer logged (a renamed metric would leave "-"), the lag is the schedule's (0 at
    step 1, 1 at step 2), and each step trains train_batch groups."""
    args = ["--smoke", "--arms", "split-k1", "--work", str(tmp_path / "work"), "--out", str(tmp_path)]
    assert bench_split.main(args) == 0
    (report,) = tmp_path.glob("*-split-smoke.md")
    (row,) = [line.split(" | ") for line in report.read_text().splitlines() if line.startswith("| toy |")]
    assert row[1] == "split-k1" and float(row[2]) > 0 and row[3] == "-"  # no co-located run to pair with
    assert "-" not in row[4:11], row
    assert 0 <= float(row[4]) <= 1 and 0 <= float(row[5]) <= 1  # trainer and rollout idle: shares of a step
    assert (row[6], row[7]) == ("0.50", "1")  # lag mean over both steps, lag max
    assert float(row[11].rstrip(" |")) == bench_longtail.SMOKE["trainer"]["train_batch"]


def test_split_arms_without_split_placement_are_named_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_split, "split_supported", lambda: False)  # a checkout before rollout.placement
    assert bench_split.main(["--arms", "split-k0,split-k1", "--work", str(tmp_path), "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().out.strip().count("\n") == 0 and not list(tmp_path.iterdir())

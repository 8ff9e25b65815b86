"""A run's first start is recorded as config.yaml even under `checkpoint.resume auto` (how `flashdapo ablate`
starts every arm, into a directory holding the config.yaml it wrote beforehand); a start that resumes a
checkpoint, or that continues a recorded run, is a resume (config.resume-<N>.yaml)."""

from __future__ import annotations

import json

from flashdapo.trainer.state.rundir import record_start


def test_the_first_start_of_resume_auto_is_recorded_as_a_first_start(tmp_path):
    (tmp_path / "config.yaml").write_text("written: beforehand\n")  # as ablation's train_or_reuse writes it
    assert record_start(tmp_path, "run-a", 0, "first: 1\n", None, [], fresh=False) == "config.yaml"
    assert (tmp_path / "config.yaml").read_text() == "written: beforehand\n"  # the run's own, kept
    assert not list(tmp_path.glob("config.resume-*.yaml"))
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["run_id"] == "run-a" and [s["config"] for s in record["starts"]] == ["config.yaml"]


def test_later_starts_of_the_same_run_are_resumes(tmp_path):
    assert record_start(tmp_path, "run-a", 0, "first: 1\n", None, [], fresh=False) == "config.yaml"
    # Interrupted before its first checkpoint, then started again with resume auto: the recorded run goes on.
    assert record_start(tmp_path, "run-a", 0, "again: 2\n", None, [], fresh=False) == "config.resume-1.yaml"
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    assert record_start(tmp_path, "run-a", 2, "third: 3\n", ckpt, [], fresh=False) == "config.resume-2.yaml"
    assert (tmp_path / "config.yaml").read_text() == "first: 1\n"
    starts = json.loads((tmp_path / "run.json").read_text())["starts"]
    assert [s["config"] for s in starts] == ["config.yaml", "config.resume-1.yaml", "config.resume-2.yaml"]


def test_a_checkpoint_resumed_without_a_record_is_still_a_resume(tmp_path):
    """A directory of an older flashdapo (no run.json): resuming its checkpoint keeps its config.yaml."""
    (tmp_path / "config.yaml").write_text("older: run\n")
    ckpt = tmp_path / "checkpoints" / "step_00000004"
    assert record_start(tmp_path, "run-b", 4, "resumed: 1\n", ckpt, [], fresh=False) == "config.resume-1.yaml"
    assert (tmp_path / "config.yaml").read_text() == "older: run\n"

"""A run owns its directory: a fresh run refuses another run's data unless told (resume, or move it aside),
a live run's lock refuses a second run, and the run-dir sequence keeps both runs' data."""

import json
import signal
import subprocess
import sys

import pytest

from flashdapo.config import merge
from flashdapo.trainer.loop import train
from flashdapo.trainer.state.checkpoint import CheckpointError
from flashdapo.trainer.state.rundir import RunDirError, claim_run_dir
from tests.helpers.runs import tiny_config


def _old_run(path):
    (path / "checkpoints" / "step_00000004").mkdir(parents=True)
    (path / "checkpoints" / "step_00000004" / "COMPLETE").write_text("{}")
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    (path / "config.yaml").write_text("old: true\n")
    return {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_a_fresh_run_refuses_a_previous_runs_data(tmp_path):
    before = _old_run(tmp_path)
    with pytest.raises(RunDirError, match=r"holds a previous run \(1 checkpoint entries, metrics.jsonl\); continue it "
                                          r"with --checkpoint.resume auto, start over with --logging.move-old-run"):
        claim_run_dir(tmp_path, resume="", move_old_run=False)
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*")
            if p.is_file() and p.name != ".flashdapo.lock"} == before
    claim_run_dir(tmp_path, resume="auto", move_old_run=False).release()  # told: continue that run


def test_move_old_run_moves_everything_aside_and_deletes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    before = _old_run(run_dir)
    claim = claim_run_dir(run_dir, resume="", move_old_run=True)
    claim.release()
    assert claim.moved_to.parent == tmp_path and claim.moved_to.name.startswith("run.old-")
    assert {p.relative_to(claim.moved_to): p.read_bytes() for p in claim.moved_to.rglob("*") if p.is_file()} == before
    assert [p.name for p in run_dir.iterdir()] == [".flashdapo.lock"]
    # A second move in the same second gets its own directory.
    _old_run(run_dir)
    again = claim_run_dir(run_dir, resume="", move_old_run=True)
    again.release()
    assert again.moved_to != claim.moved_to and (again.moved_to / "metrics.jsonl").is_file()


def test_a_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("x")
    with pytest.raises(RunDirError, match=r"run is a file, not a directory"):
        claim_run_dir(tmp_path / "run", resume="", move_old_run=False)


def test_a_live_runs_lock_refuses_a_second_run_and_dies_with_it(tmp_path):
    held = claim_run_dir(tmp_path, resume="", move_old_run=False)
    with pytest.raises(RunDirError, match=r"in use by a live run \(pid \d+ on "):
        claim_run_dir(tmp_path, resume="auto", move_old_run=False)
    held.release()
    # Another process holds it, then is SIGKILLed: the kernel releases the lock.
    code = ("import sys, time; from pathlib import Path; from flashdapo.trainer.state.rundir import claim_run_dir; "
            f"c = claim_run_dir(Path({str(tmp_path)!r}), 'auto', False); print('held', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match="in use by a live run"):
            claim_run_dir(tmp_path, resume="auto", move_old_run=False)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    claim_run_dir(tmp_path, resume="auto", move_old_run=False).release()


def test_a_failed_resume_leaves_config_yaml_alone(tmp_path):
    _old_run(tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        train(tiny_config(tmp_path, checkpoint={"resume": str(tmp_path / "absent")}))
    assert (tmp_path / "config.yaml").read_text() == "old: true\n"
    claim_run_dir(tmp_path, resume="auto", move_old_run=False).release()  # and the lock was released


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _markers(run_dir):
    return {p.name: json.loads((p / "COMPLETE").read_text())["run_id"] for p in (run_dir / "checkpoints").iterdir()}


@pytest.mark.slow
def test_run_then_fresh_run_then_resume_keeps_both_runs_and_resumes_the_right_one(tmp_path):
    run_dir = tmp_path / "run"
    quick = {"trainer": {"total_steps": 2, "val_before_train": False, "val_every": 0},
             "checkpoint": {"save_every": 1, "keep_last": 1, "export_hf": False}, "logging": {"plot": False}}
    first = train(tiny_config(run_dir, **quick))
    first_metrics, first_markers = _metrics(run_dir), _markers(run_dir)
    assert list(first_markers.values()) == [first.run_id]
    # A second fresh run in the same directory is refused and changes nothing.
    with pytest.raises(RunDirError, match="holds a previous run"):
        train(tiny_config(run_dir, **quick))
    assert _metrics(run_dir) == first_metrics and _markers(run_dir) == first_markers
    # Told to move the old run aside: it starts fresh, the first run's files kept next to it.
    second = train(merge(tiny_config(run_dir, **quick), {"logging": {"move_old_run": True}, "trainer": {"seed": 1}}))
    moved = next(tmp_path.glob("run.old-*"))
    assert _metrics(moved) == first_metrics and _markers(moved) == first_markers
    assert second.run_id != first.run_id and list(_markers(run_dir).values()) == [second.run_id]
    second_metrics = _metrics(run_dir)
    # resume auto continues the second run (its checkpoint, its metrics), not the first.
    third = train(merge(tiny_config(run_dir, **quick), {"trainer": {"seed": 1, "total_steps": 3},
                                                          "checkpoint": {"resume": "auto"}}))
    assert third.run_id == second.run_id and third.start_step == 2
    resumed = _metrics(run_dir)
    assert resumed[:2] == second_metrics and [r["step"] for r in resumed] == [1, 2, 3]
    assert _markers(run_dir) == {"step_00000003": second.run_id}


@pytest.fixture
def read_only(tmp_path):
    """A directory nothing can be written in: chmod for a normal user; a read-only bind mount for root (which
    permissions do not stop); skipped where neither works."""
    import contextlib
    import os

    made = []

    def make(path):
        path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            path.chmod(0o555)
            made.append(("chmod", path))
            return path
        done = subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip("running as root without mount: cannot make a read-only directory")
        made.append(("mount", path))
        return path

    yield make
    for how, path in made:
        with contextlib.suppress(Exception):
            path.chmod(0o755) if how == "chmod" else subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_checkpoints_dir_is_refused_at_start_before_any_work(tmp_path, read_only):
    run_dir = tmp_path / "run"
    read_only(run_dir / "checkpoints")
    with pytest.raises(RunDirError, match=r"run/checkpoints is not writable \(Read-only file system|Permission denied"):
        train(tiny_config(run_dir, checkpoint={"save_every": 1}))
    assert not (run_dir / "metrics.jsonl").exists()  # refused before the warm-up and the first step


def test_each_start_keeps_its_config_and_run_json_lists_the_starts(tmp_path):
    from flashdapo.trainer.state.rundir import record_start, recorded_run_id

    assert recorded_run_id(tmp_path) is None
    assert record_start(tmp_path, "run-a", 0, "first: 1\n", None, [], fresh=True) == "config.yaml"
    ckpt = tmp_path / "checkpoints" / "step_00000004"
    assert record_start(tmp_path, "run-a", 4, "second: 2\n", ckpt, [("optim.lr", 1e-6, 2e-6)],
                        fresh=False) == "config.resume-1.yaml"
    assert record_start(tmp_path, "run-a", 6, "third: 3\n", ckpt, [], fresh=False) == "config.resume-2.yaml"
    assert (tmp_path / "config.yaml").read_text() == "first: 1\n"
    assert (tmp_path / "config.resume-1.yaml").read_text() == "second: 2\n"
    record = json.loads((tmp_path / "run.json").read_text())
    assert recorded_run_id(tmp_path) == "run-a" and [s["step"] for s in record["starts"]] == [0, 4, 6]
    assert record["starts"][1]["accepted_changes"] == {"optim.lr": [1e-6, 2e-6]}
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(RunDirError, match=r"run.json: cannot read it"):
        recorded_run_id(tmp_path)

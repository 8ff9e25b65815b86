"""Split placement resumes from every checkpoint position up to the last, and its rollout parts are its run's.

A checkpoint within max_lag of the end (its cut queued every batch left, so the rollout side has nothing to
generate) resumes like any other and gives the uninterrupted run's metrics and exported weights, bit for bit
(gloo, torch engine, 1 trainer + 1 rollout rank, 4 steps, a checkpoint after each). A split checkpoint
resumed into a new run dir (--checkpoint.resume PATH) reads its parts from its own run dir; a part written by
another run is refused, and a fresh run does not start in a directory holding a previous run's parts."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashdapo.trainer.split.cut import cut_dir, part_dir, require_part
from flashdapo.trainer.state.checkpoint import CheckpointError
from flashdapo.trainer.state.rundir import RunDirError, claim_run_dir
from tests.helpers.runs import ROOT, TINY, subprocess_env

TOTAL = 4
DROP = ("timing_s/", "perf/", "split/trainer_idle", "split/rollout_idle", "split/weight_push_s",
        "split/batch_transfer_s", "split/staged_max")


def _cmd(run_dir: Path, k: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "flashdapo",
            "train", *TINY, "--rollout.placement", "split", "--rollout.rollout-ranks", "1", "--rollout.max-lag",
            str(k), "--algorithm.filter-metric", "score", "--rollout.max-response-length", "24",
            "--algorithm.dynamic-sampling", "True", "--algorithm.max-gen-batches", "0", "--trainer.gen-batch", "8",
            "--trainer.total-steps", str(TOTAL), "--checkpoint.save-every", "1", "--checkpoint.keep-last", "5",
            "--logging.run-dir", str(run_dir), *extra]


def _rows(run_dir: Path):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(DROP)} for r in rows]


def _as_of(straight: Path, dest: Path, c: int) -> Path:
    """A copy of the finished run as it stood once checkpoint c was written: its newer checkpoints, its
    export and its metrics after step c removed (the rollout parts of later cuts are left: a resume must not
    read them)."""
    shutil.copytree(straight, dest)
    for ckpt in (dest / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1].split(".")[0]) > c:
            shutil.rmtree(ckpt)
    shutil.rmtree(dest / "export")
    rows = (dest / "metrics.jsonl").read_text().splitlines()
    (dest / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r).get("step", 0) <= c))
    return dest


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("k", "cuts"), [(1, (3, 4)), (0, (4,)), (2, (3,))])
def test_split_resume_from_the_last_checkpoints_is_the_uninterrupted_run(tmp_path, k, cuts):
    straight = tmp_path / "straight"
    ref = subprocess.run(_cmd(straight, k), capture_output=True, text=True, env=subprocess_env(), cwd=ROOT,
                         timeout=400)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    expected = _rows(straight)
    assert len(expected) == TOTAL
    x = load_file(straight / "export" / "model.safetensors")
    for c in cuts:
        run_dir = _as_of(straight, tmp_path / f"from_{c}", c)
        resumed = subprocess.run(_cmd(run_dir, k, "--checkpoint.resume", "auto"), capture_output=True, text=True,
                                 env=subprocess_env(), cwd=ROOT, timeout=300)
        out = resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert resumed.returncode == 0, f"resume from step {c} (k = {k}):\n{out}"
        assert f"step_{c:08d} at step {c}" in resumed.stdout, out  # a real resume, from that checkpoint
        assert "killed by a signal" not in out and "failed" not in out, out
        assert _rows(run_dir) == expected, f"resume from step {c} (k = {k})"
        y = load_file(run_dir / "export" / "model.safetensors")
        assert x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x), f"resume from step {c} (k = {k})"
    if k == 1:  # --checkpoint.resume PATH of a split checkpoint into a new run dir: its parts are read from the
        # checkpoint's run dir, and the run goes on as the uninterrupted one
        c, run_dir = 2, tmp_path / "elsewhere"
        resumed = subprocess.run(_cmd(run_dir, k, "--checkpoint.resume", str(straight / "checkpoints" / f"step_{c:08d}")),
                                 capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=300)
        out = resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert resumed.returncode == 0, out
        assert _rows(run_dir) == expected[c:], out
        y = load_file(run_dir / "export" / "model.safetensors")
        assert x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)
        parts = sorted(p.name for p in (run_dir / "split_rollout").iterdir())
        assert parts and all((run_dir / "split_rollout" / p / "RUN_ID").read_text() ==
                             (straight / "split_rollout" / p / "RUN_ID").read_text() for p in parts)


def _part(run_dir: Path, step: int, run_id: str | None) -> None:
    part = part_dir(run_dir, step)
    part.mkdir(parents=True)
    torch.save([], part / "queue.pt")
    torch.save({"sampler": {}}, part / "rank0.pt")
    if run_id is not None:
        (part / "RUN_ID").write_text(run_id)
    (part / "COMPLETE").write_text(json.dumps({"step": step, "boundary": step}))


def test_a_part_of_another_run_is_refused_naming_it(tmp_path):
    checkpoint = tmp_path / "checkpoints" / "step_00000002"
    _part(tmp_path, 2, "run-b")
    with pytest.raises(CheckpointError, match=r"step_00000002: the rollout side's part of this cut .*part_00000002\) "
                                              r"was written by run run-b, not by this checkpoint's run run-a"):
        require_part(tmp_path, 2, checkpoint, "run-a")
    require_part(tmp_path, 2, checkpoint, "run-b")  # its own run's part
    _part(tmp_path, 3, None)  # a part written before parts carried their run id
    require_part(tmp_path, 3, checkpoint, "run-a")
    assert cut_dir(checkpoint) == tmp_path


def test_a_fresh_run_refuses_a_directory_holding_rollout_parts_or_moves_them_aside(tmp_path):
    run_dir = tmp_path / "run"
    _part(run_dir, 4, "old-run")
    with pytest.raises(RunDirError, match=r"holds a previous run \(split_rollout/\); continue it with "
                                          r"--checkpoint.resume auto, start over with --logging.move-old-run"):
        claim_run_dir(run_dir, resume="", move_old_run=False)
    claim = claim_run_dir(run_dir, resume="", move_old_run=True)
    claim.release()
    assert not (run_dir / "split_rollout").exists()
    assert (claim.moved_to / "split_rollout" / "part_00000004" / "RUN_ID").read_text() == "old-run"

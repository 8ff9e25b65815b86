"""Split placement's checkpoint is a consistent cut of both sides: SIGKILL a trainer rank or a rollout rank in
the middle of a k = 1 run, then `--checkpoint.resume auto` gives the uninterrupted run's metrics and exported
weights, bit for bit (gloo, torch engine, 1 trainer + 1 rollout rank)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.runs import ROOT, TINY, subprocess_env

ARGS = [*TINY, "--rollout.placement", "split", "--rollout.rollout-ranks", "1", "--rollout.max-lag", "1",
        "--algorithm.filter-metric", "score", "--rollout.max-response-length", "24", "--algorithm.dynamic-sampling",
        "True", "--algorithm.max-gen-batches", "0", "--trainer.gen-batch", "8", "--trainer.total-steps", "5",
        "--checkpoint.save-every", "1", "--checkpoint.keep-last", "5"]
DROP = ("timing_s/", "perf/", "split/trainer_idle", "split/rollout_idle", "split/weight_push_s",
        "split/batch_transfer_s", "split/staged_max")


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "flashdapo",
            "train", *ARGS, "--logging.run-dir", str(run_dir), *extra]


def _rank_pid(tag: str, rank: int) -> int | None:
    """The pid of the torchrun worker of RANK `rank` started with FLASHDAPO_TEST_TAG=tag."""
    for entry in Path("/proc").iterdir():
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"FLASHDAPO_TEST_TAG={tag}".encode() in env and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


def _rows(run_dir: Path):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(DROP)} for r in rows]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("role", "rank"), [("trainer", 0), ("rollout", 1)])
def test_sigkill_of_either_side_then_resume_is_the_uninterrupted_run(tmp_path, role, rank):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    env = {**subprocess_env(), "FLASHDAPO_TEST_TAG": str(killed)}
    ref = subprocess.Popen(_cmd(straight), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=subprocess_env(), cwd=ROOT)
    victim = subprocess.Popen(_cmd(killed), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=ROOT)
    metrics, deadline = killed / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and victim.poll() is None:  # SIGKILL once step 3 is logged
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            pid = _rank_pid(str(killed), rank)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                break
        time.sleep(0.05)
    out = victim.communicate(timeout=120)[0]
    assert victim.returncode != 0, f"the {role} rank was not killed in time:\n{out[-3000:]}"
    assert ref.communicate(timeout=400)[0] is not None and ref.returncode == 0
    resumed = subprocess.run(_cmd(killed, "--checkpoint.resume", "auto"), capture_output=True, text=True,
                             env=subprocess_env(), cwd=ROOT, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    found = re.search(r"resumed from \S+step_(\d+) at step (\d+)", resumed.stdout)
    assert found and int(found.group(2)) >= 1, resumed.stdout[-3000:]  # a real resume, not a fresh start
    step = int(found.group(2))
    part = json.loads((killed / "split_rollout" / f"part_{step:08d}" / "COMPLETE").read_text())
    assert part == {"step": step, "boundary": step + 1}  # the cut queued batch step+1 (k = 1)
    a, r = _rows(straight), _rows(killed)
    assert len(a) == 5 and r == a
    assert any(row["split/older_responses"] > 0 for row in a)  # groups rolled over: part of the cut
    x, y = load_file(straight / "export" / "model.safetensors"), load_file(killed / "export" / "model.safetensors")
    assert x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)

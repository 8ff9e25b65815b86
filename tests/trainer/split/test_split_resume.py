"""Split placement's checkpoint is a consistent cut of both sides: SIGKILL a trainer rank or a rollout rank in
the middle of a k = 1 run, then `--checkpoint.resume auto` gives the uninterrupted run's metrics and exported
weights, bit for bit (gloo, torch engine, 1 trainer + 1 rollout rank)."""

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.runs import ROOT, launch, rank_pid, split_cmd, subprocess_env, wait_rows

ARGS = ["--rollout.max-lag", "1", "--algorithm.filter-metric", "score", "--rollout.max-response-length", "24",
        "--algorithm.dynamic-sampling", "True", "--algorithm.max-gen-batches", "0", "--trainer.gen-batch", "8",
        "--trainer.total-steps", "5", "--checkpoint.save-every", "1", "--checkpoint.keep-last", "5"]
DROP = ("timing_s/", "perf/", "split/trainer_idle", "split/rollout_idle", "split/weight_push_s",
        "split/batch_transfer_s", "split/staged_max")


def _rows(run_dir: Path):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(DROP)} for r in rows]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("role", "rank"), [("trainer", 0), ("rollout", 1)])
def test_sigkill_of_either_side_then_resume_is_the_uninterrupted_run(tmp_path, role, rank):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    ref = launch(split_cmd(straight, *ARGS))
    victim = launch(split_cmd(killed, *ARGS), tag=killed)
    try:
        wait_rows(victim, killed, 3)  # SIGKILL once step 3 is logged
        os.kill(rank_pid(killed, rank), signal.SIGKILL)
    except (AssertionError, TypeError):
        pass  # the run ended first: said below
    out = victim.communicate(timeout=120)[0]
    assert victim.returncode != 0, f"the {role} rank was not killed in time:\n{out[-3000:]}"
    assert ref.communicate(timeout=400)[0] is not None and ref.returncode == 0
    resumed = subprocess.run(split_cmd(killed, *ARGS, "--checkpoint.resume", "auto"), capture_output=True, text=True,
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

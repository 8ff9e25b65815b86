"""What split placement says when a rank hangs (docs/split.md, "Waits poll"): a SIGSTOPped rollout rank is named
in one line ('rank 1 (rollout rank 0) has not answered ...') once its liveness counter has stood still for the
stale delay, before any collective timeout: the trainer's weight push waits for the receivers in the store
(polling liveness) before each broadcast instead of sitting in the bridge's gloo broadcast (gloo, torch engine,
1 trainer + 1 rollout rank; the delay shortened through the FLASHDAPO_SPLIT_STALE_S test hook)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT, TINY, subprocess_env

STALE_S = 5


def _cmd(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "flashdapo",
            "train", *TINY, "--rollout.placement", "split", "--rollout.rollout-ranks", "1", "--rollout.max-lag", "1",
            "--rollout.max-response-length", "24", "--trainer.total-steps", "40",
            "--checkpoint.save-every", "0", "--logging.run-dir", str(run_dir)]


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


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stopped_rollout_rank_is_named_before_any_collective_timeout(tmp_path):
    run_dir = tmp_path / "run"
    env = {**subprocess_env(), "FLASHDAPO_TEST_TAG": str(run_dir), "FLASHDAPO_SPLIT_STALE_S": str(STALE_S)}
    job = subprocess.Popen(_cmd(run_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           cwd=ROOT)
    metrics, deadline, pid, stopped_at = run_dir / "metrics.jsonl", time.time() + 300, None, None
    try:
        while time.time() < deadline and job.poll() is None:  # SIGSTOP the rollout rank once step 2 is logged
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                pid = _rank_pid(str(run_dir), 1)
                if pid is not None:
                    os.kill(pid, signal.SIGSTOP)
                    stopped_at = time.time()
                    break
            time.sleep(0.05)
        assert stopped_at is not None, "the rollout rank was not stopped in time"
        out = job.communicate(timeout=200)[0]
        took = time.time() - stopped_at
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert f"rank 1 (rollout rank 0) has not answered for {STALE_S} s while rank 0 (trainer rank 0) waited for" in out, \
        out[-4000:]
    assert "Timed out waiting" not in out and "killed by a signal" not in out, out[-4000:]
    assert took < 110, f"{took:.0f} s from the stop to the job's end:\n{out[-4000:]}"


def _wait_rows(job: subprocess.Popen, metrics: Path, rows: int, deadline: float) -> None:
    while time.time() < deadline and job.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {rows} was not logged in time")


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_to_a_rollout_rank_then_ctrl_c_stop_cleanly_in_one_line_each(tmp_path):
    """SIGTERM to the rollout worker only: one notice, the run goes on (the rollout side has no checkpoint of its
    own). Then Ctrl-C (SIGINT to the whole process group, as a terminal sends it): the trainer side stops after
    its step with a checkpoint, and the rollout rank ends with it at once: no 'killed by a signal' or 'failed'
    line, no launcher SIGKILL of a rollout rank that ignored the signal."""
    run_dir = tmp_path / "run"
    env = {**subprocess_env(), "FLASHDAPO_TEST_TAG": str(run_dir)}
    job = subprocess.Popen(_cmd(run_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           cwd=ROOT, start_new_session=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
    try:
        _wait_rows(job, metrics, 2, deadline)
        os.kill(_rank_pid(str(run_dir), 1), signal.SIGTERM)
        _wait_rows(job, metrics, 4, deadline)  # two more steps: the run went on
        os.killpg(job.pid, signal.SIGINT)
        stopped_at = time.time()
        out = job.communicate(timeout=120)[0]
        took = time.time() - stopped_at
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert "(a rollout rank) got SIGTERM: the rollout side saves nothing and stops when the trainer side does" in out
    found = [line for line in out.splitlines() if line.startswith("flashdapo: stopped at step")]
    assert len(found) == 1 and "by Ctrl-C, after saving its checkpoint" in found[0], out[-4000:]
    step = int(found[0].split()[4])
    assert (run_dir / "checkpoints" / f"step_{step:08d}").is_dir()
    assert "flashdapo: rank 1 (rollout rank 0) stops with the trainer side" in out, out[-4000:]
    for wrong in ("killed by a signal", "failed (its error is above)", "forcefully exiting", "Traceback (most recent "
                  "call last):\n  File \"/", "lost its peer"):
        assert wrong not in out.split("SignalException")[0], out[-4000:]
    assert took < 25, f"{took:.0f} s from Ctrl-C to the end:\n{out[-4000:]}"

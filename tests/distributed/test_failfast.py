"""Any rank's failure ends the whole torchrun job within seconds, printing that rank's error once, with no
rank left running; the newest complete checkpoint then resumes (gloo ranks on CPU, torch engine)."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT, TINY, TRAINER_SCRIPTS, run_metrics, subprocess_env, torchrun

RUN = [*TINY, "--trainer.total-steps", "3", "--checkpoint.save-every", "1"]
ERROR = "injected failure in {} on rank 1 at step 2"


def _launch(nproc: int, nnodes: int, node_rank: int, port: int, where: str, run_dir: Path,
            *extra: str) -> subprocess.Popen:
    launcher = (["--standalone"] if nnodes == 1 else
                [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=static",
                 "--master-addr=127.0.0.1", f"--master-port={port}"])
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, f"--nproc-per-node={nproc}",
           str(TRAINER_SCRIPTS / "raise_on_rank.py"), where, "1", "2", *RUN, "--logging.run-dir", str(run_dir),
           *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env(),
                            cwd=ROOT)


def _finish(procs: list[subprocess.Popen], run_dir: Path) -> str:
    """Wait for the launchers; check they failed within 60 s of the injected error and no rank lives on."""
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    except subprocess.TimeoutExpired:
        ranks = [int(f.read_text()) for f in run_dir.glob("pid_*")]  # torchrun starts ranks in sessions of their own
        for pid in ranks + [p.pid for p in procs]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail("the job was still running 3 minutes after its start")
    ended = time.time()
    assert all(p.returncode != 0 for p in procs), outputs
    assert ended - float((run_dir / "failed_at").read_text()) < 60, outputs
    for pid_file in run_dir.glob("pid_*"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)
    return "\n".join(outputs)


def _check_reported_once(out: str, what: str) -> None:
    """Rank 1's error, once; rank 0 reports nothing of its own (one line at most, if torchrun's SIGTERM to
    the ranks of the failed one's node does not come first)."""
    assert out.count(ERROR.format(what)) == 1, out
    assert "flashdapo: rank 1 failed; stopping every rank" in out
    assert not re.search(r"rank ?0\]?:? .*Traceback|Connection closed by peer", out), out  # no second report


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("where, what", [("reward", "reward scoring"), ("generate", "generation")])
def test_one_rank_failing_ends_the_job(tmp_path, where, what):
    out = _finish([_launch(2, 1, 0, 0, where, tmp_path)], tmp_path)
    _check_reported_once(out, what)
    if where == "reward":  # the step-1 checkpoint is intact: resume it to the end
        done = torchrun(2, "-m", "flashdapo", "train", *RUN, "--logging.run-dir", str(tmp_path),
                        "--checkpoint.resume", "auto")
        assert re.search(r"resumed from \S+step_00000001 at step 1", done.stdout), done.stdout
        assert [r["step"] for r in run_metrics(tmp_path)] == [1, 2, 3]


@pytest.mark.distributed
@pytest.mark.slow
def test_failure_reaches_a_rank_that_no_launcher_would_stop(tmp_path):
    """Two launchers (two 'nodes' of one rank each): rank 0 waits 10 minutes where rank 1 fails, as in an
    NCCL collective; no launcher kills it (its own worker is healthy), the failure report does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [_launch(1, 2, node, port, "reward-stall", tmp_path) for node in (0, 1)]
    out = _finish(procs, tmp_path)
    _check_reported_once(out, "reward scoring")
    assert "flashdapo: rank 0 stops: rank 1 failed (its error is above)" in out


@pytest.mark.distributed
@pytest.mark.slow
def test_a_hung_rank_ends_the_job_after_the_collective_timeout(tmp_path):
    """Rank 1 hangs without raising; rank 0's next collective fails after trainer.collective_timeout_s and
    its error (the timeout) is the one reported."""
    out = _finish([_launch(2, 1, 0, 0, "reward-hang", tmp_path, "--trainer.collective-timeout-s", "5")],
                  tmp_path)
    assert "flashdapo: rank 0 failed; stopping every rank" in out
    assert out.count("flashdapo: rank 0 failed") == 1 and "injected failure" not in out
    assert re.search(r"[Tt]imed? ?out", out), out


@pytest.mark.distributed
@pytest.mark.slow
def test_a_killed_rank_ends_the_job_with_one_line_and_no_traceback(tmp_path):
    """Rank 1 is SIGKILLed mid-step (as by the OOM killer) and reports nothing; rank 0's collective fails with
    gloo's 'Connection reset/closed by peer': one line saying a peer died, no worker traceback."""
    out = _finish([_launch(2, 1, 0, 0, "reward-kill", tmp_path)], tmp_path)
    assert "flashdapo: error: a collective lost its peer" in out and "(rank 0; stopping every rank)" in out, out
    worker_lines = [line for line in out.splitlines() if "/flashdapo/" in line or "pair.cc" in line]
    assert not worker_lines, out  # no frame of flashdapo's code, no gloo message: torchrun's summary only

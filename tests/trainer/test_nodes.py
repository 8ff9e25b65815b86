"""Two nodes simulated on one machine: two torchrun launchers (`--nnodes 2 --nproc-per-node 1`, c10d
rendezvous, which gives rank 0 to either), each in a working directory of its own as on two machines.
A relative run directory is then a different directory per node: refused at start, in one line naming the
rank and host that do not see rank 0's; a shared absolute one trains and resumes."""

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

from tests.helpers.runs import TINY, TRAINER_SCRIPTS, run_metrics, subprocess_env

RUN = [*TINY, "--checkpoint.save-every", "1", "--checkpoint.export-hf", "False"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path: Path, run_dir: str, *extra: str) -> tuple[list[int], str]:
    """Start both launchers (node directories tmp_path/node0 and node1), wait for both; their exit codes
    and output."""
    port, procs = _free_port(), []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=nodes-{port}",
               "--max-restarts=0", "-m", "flashdapo", "train", *RUN, "--logging.run-dir", run_dir, *extra]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=subprocess_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    except subprocess.TimeoutExpired:
        # Seen once in a full 2-worker suite run (alone it takes ~30 s): what each node had printed says where,
        # with every worker's stacks (SIGUSR1, flashdapo/tools/stack_dumps.py; it also ends the launchers).
        for sig in (signal.SIGUSR1, signal.SIGKILL):
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
            time.sleep(2)
        tails = [f"node{n}: ...{(p.communicate()[0] or '')[-6000:]}" for n, p in enumerate(procs)]
        pytest.fail("the two launchers were still running after 4 minutes (a hang)\n" + "\n".join(tails))
    return [p.returncode for p in procs], "\n".join(outputs)


@pytest.mark.distributed
@pytest.mark.slow
def test_rank_local_run_dirs_are_refused_at_start_naming_the_rank_that_cannot_see_rank0s(tmp_path):
    started = time.monotonic()
    codes, out = _two_nodes(tmp_path, "run")  # relative: node0/run and node1/run
    assert all(code != 0 for code in codes), out
    errors = [line for line in out.splitlines() if line.startswith("flashdapo: error:")]
    assert len(errors) == 1, out
    assert re.search(r"logging.run_dir=run: rank 1 on host \S+ does not see the run directory rank 0 writes on host "
                     r"\S+ \(\S+/node[01]/run: no such directory\); every rank must see one run directory", errors[0])
    assert "absolute path" in errors[0], errors[0]
    assert not [line for line in out.splitlines() if "/flashdapo/" in line], out  # torchrun's summaries only
    assert "world size 2" not in out  # refused before the model was built
    for node in (0, 1):
        assert not (tmp_path / f"node{node}" / "run" / "metrics.jsonl").exists()
    assert time.monotonic() - started < 200


@pytest.mark.distributed
@pytest.mark.slow
def test_a_shared_absolute_run_dir_trains_and_resumes_on_two_nodes(tmp_path):
    shared = tmp_path / "shared" / "run"
    codes, out = _two_nodes(tmp_path, str(shared), "--trainer.total-steps", "2")
    assert codes == [0, 0], out
    assert [r["step"] for r in run_metrics(shared)] == [1, 2]
    assert not list(shared.glob(".flashdapo-storage-check-*"))  # the token file is removed
    codes, out = _two_nodes(tmp_path, str(shared), "--trainer.total-steps", "3", "--checkpoint.resume", "auto")
    assert codes == [0, 0], out
    assert re.search(r"resumed from \S+step_00000002 at step 2", out), out
    assert [r["step"] for r in run_metrics(shared)] == [1, 2, 3]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_stalled_at_start_fails_the_job_after_setup_timeout_not_collective_timeout(tmp_path):
    """Rank 1 stalls 10 minutes at the start-up checks: rank 0's wait ends after trainer.setup_timeout_s (5 s)
    in one line naming the setting, and no rank outlives the job (collective_timeout_s stays 1800 s)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(TRAINER_SCRIPTS / "stall_at_start.py"), "1", "600", *RUN, "--trainer.setup-timeout-s", "5",
           "--logging.run-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=150)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid_file in tmp_path.glob("pid_*"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        pytest.fail("the job still waited 150 s after its start: the start-up checks did not time out")
    assert proc.returncode != 0
    errors = [line for line in out.splitlines() if line.startswith("flashdapo: error:")]
    assert len(errors) == 1 and "rank 0: the start-up checks waited trainer.setup_timeout_s=5 s" in errors[0], out
    for pid_file in tmp_path.glob("pid_*"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)

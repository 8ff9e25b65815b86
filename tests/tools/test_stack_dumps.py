"""kill -USR1 on a running rank prints every thread's stack and the run goes on (flashdapo/tools/stack_dumps.py);
once the command is over, SIGUSR1 is back to what it was."""

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.helpers.runs import ROOT, TINY, launch, rank_pid, run_metrics, subprocess_env, torchrun_cmd, wait_rows


@pytest.mark.distributed
def test_sigusr1_to_a_torchrun_worker_prints_its_stacks_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    job = launch(torchrun_cmd(1, "-m", "flashdapo", "train", *TINY, "--trainer.total-steps", "4",
                              "--logging.run-dir", str(run_dir)), tag=run_dir)
    try:
        wait_rows(job, run_dir, 1)
        os.kill(rank_pid(run_dir, 0), signal.SIGUSR1)
        out = job.communicate(timeout=300)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-4000:]
    # every thread: the run directory's lock watcher, then the main one, inside the training loop
    assert re.search(r"^Thread 0x[0-9a-f]+ \(most recent call first\):\n  File .*rundir\.py", out, re.M), out[-4000:]
    main = out[out.index("Current thread 0x"):] if "Current thread 0x" in out else ""
    assert re.search(r'File ".*flashdapo.trainer.loop\.py", line \d+ in train_step', main), out[-4000:]
    assert [r["step"] for r in run_metrics(run_dir)] == [1, 2, 3, 4]


def test_sigusr1_after_the_command_has_its_default_action_again():
    code = ("from flashdapo.__main__ import main; import os, signal; "
            "assert main(['config', '--trainer.total-steps', '1']) == 0; os.kill(os.getpid(), signal.SIGUSR1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          cwd=ROOT, timeout=120)
    assert proc.returncode == -signal.SIGUSR1, proc.stderr[-3000:]
    assert "Current thread" not in proc.stderr

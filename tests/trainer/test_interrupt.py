"""Ctrl-C: the first stops after the running step with its checkpoint, in one line, and the resumed run equals
the uninterrupted one bit for bit; a second stops at once without a checkpoint; under torchrun every rank
stops after the same step."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from flashdapo.__main__ import main as cli
from flashdapo.trainer import loop
from flashdapo.trainer.interrupt import Interrupted
from flashdapo.trainer.loop import train

from .test_distributed import ROOT, TINY, _env
from .test_resume import _config, _metrics, _resume


def _ctrl_c_during(monkeypatch, step: int, times: int = 1, signum: int = signal.SIGINT):
    """`signum` (SIGINT: Ctrl-C) to this process `times` times in the middle of training step `step` (after
    its rollouts)."""
    real = loop.train_step

    def step_with_ctrl_c(run, n):
        if n == step:
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return real(run, n)

    monkeypatch.setattr(loop, "train_step", step_with_ctrl_c)


def test_ctrl_c_stops_after_the_step_with_its_checkpoint_and_resumes_bitwise(tmp_path, monkeypatch, capsys):
    uninterrupted, stopped = tmp_path / "uninterrupted", tmp_path / "stopped"
    train(_config(uninterrupted, trainer={"total_steps": 3}, checkpoint={"save_every": 0}))
    _ctrl_c_during(monkeypatch, 2)
    with pytest.raises(Interrupted, match=r"^stopped at step 2 by Ctrl-C, after saving its checkpoint \S+"
                                          r"step_00000002; resume with --checkpoint.resume auto$"):
        train(_config(stopped, trainer={"total_steps": 3}, checkpoint={"save_every": 0}))
    assert "Ctrl-C: stopping after step 2" in capsys.readouterr().err
    assert [r["step"] for r in _metrics(stopped)] == [1, 2]
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["step_00000002"]
    monkeypatch.undo()
    train(_resume(stopped, trainer={"total_steps": 3}, checkpoint={"save_every": 0}))
    assert _metrics(stopped) == _metrics(uninterrupted)


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, monkeypatch):
    _ctrl_c_during(monkeypatch, 2, times=2)
    with pytest.raises(Interrupted, match=r"stopped by Ctrl-C during step 2, without a checkpoint of it; the newest "
                                          r"checkpoint is \S+step_00000001; resume with --checkpoint.resume auto"):
        train(_config(tmp_path, trainer={"total_steps": 3}))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]


def test_ctrl_c_on_the_command_line_is_one_line(tmp_path, monkeypatch, capsys):
    _ctrl_c_during(monkeypatch, 1)
    assert cli(["train", *TINY, "--trainer.total-steps", "2", "--logging.run-dir", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(r"^flashdapo: stopped at step 1 by Ctrl-C, after saving its checkpoint \S+step_00000001; "
                     r"resume with --checkpoint.resume auto$", err, re.M), err


def test_sigterm_stops_after_the_step_with_its_checkpoint_exit_143(tmp_path, monkeypatch, capsys):
    """What a scheduler sends before it ends a job: the same stop as Ctrl-C, named SIGTERM, exit 128 + 15."""
    _ctrl_c_during(monkeypatch, 2, signum=signal.SIGTERM)
    assert cli(["train", *TINY, "--trainer.total-steps", "3", "--logging.run-dir", str(tmp_path)]) == 143
    err = capsys.readouterr().err
    assert "Traceback" not in err and "flashdapo: SIGTERM: stopping after step 2" in err, err
    assert re.search(r"^flashdapo: stopped at step 2 by SIGTERM, after saving its checkpoint \S+step_00000002; "
                     r"resume with --checkpoint.resume auto$", err, re.M), err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the handler is removed when the run ends"


@pytest.mark.distributed
@pytest.mark.slow
def test_ctrl_c_to_torchrun_stops_every_rank_after_the_same_step(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "flashdapo",
           "train", *TINY, "--trainer.total-steps", "500", "--checkpoint.save-every", "0", "--logging.run-dir",
           str(tmp_path)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT)
    metrics, start = tmp_path / "metrics.jsonl", time.time()
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and time.time() - start < 240:
        time.sleep(0.2)
    launcher.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends (torchrun forwards it to the ranks)
    out = launcher.communicate(timeout=120)[0]
    match = re.search(r"flashdapo: stopped at step (\d+) by Ctrl-C, after saving its checkpoint", out)
    assert match and out.count("flashdapo: stopped at step") == 1 and "flashdapo: error" not in out, out
    step = int(match.group(1))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [f"step_{step:08d}"]
    assert "failed" not in out  # no rank reported an error of its own (failfast)
    # The only traceback is torchrun's own (its launcher re-raises the SIGINT it forwarded), none of a rank.
    assert out.count("Traceback") <= 1 and ("Traceback" not in out or "SignalException" in out), out

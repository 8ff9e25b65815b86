"""Ctrl-C: the first stops after the running step with its checkpoint, in one line, and the resumed run equals
the uninterrupted one bit for bit; a second stops at once without a checkpoint; under torchrun every rank
stops after the same step. SIGTERM at any point of setup, a finalizer included, stops before the first step."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashdapo.__main__ import main as cli
from flashdapo.distributed.interrupt import Interrupted
from flashdapo.trainer import loop
from flashdapo.trainer.loop import train
from flashdapo.trainer.state.rundir import claim_run_dir
from tests.helpers.runs import ROOT, TINY, quick_config, resume_config, run_metrics, subprocess_env


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
    train(quick_config(uninterrupted, trainer={"total_steps": 3}, checkpoint={"save_every": 0}))
    _ctrl_c_during(monkeypatch, 2)
    with pytest.raises(Interrupted, match=r"^stopped at step 2 by Ctrl-C, after saving its checkpoint \S+"
                                          r"step_00000002; resume with --checkpoint.resume auto$"):
        train(quick_config(stopped, trainer={"total_steps": 3}, checkpoint={"save_every": 0}))
    assert "Ctrl-C: stopping after step 2" in capsys.readouterr().err
    assert [r["step"] for r in run_metrics(stopped)] == [1, 2]
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["step_00000002"]
    monkeypatch.undo()
    train(resume_config(stopped, trainer={"total_steps": 3}, checkpoint={"save_every": 0}))
    assert run_metrics(stopped) == run_metrics(uninterrupted)


def test_ctrl_c_during_a_steps_checkpoint_save_announces_the_step_it_stops_after(tmp_path, monkeypatch, capsys):
    """A Ctrl-C after step 1's stop check, while its checkpoint is written: the run stops after step 2, and its
    notice says step 2, not step 1."""
    real = loop.save_checkpoint

    def save_with_ctrl_c(run_dir, env, policy, optimizer, state, *args):
        if state.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(run_dir, env, policy, optimizer, state, *args)

    monkeypatch.setattr(loop, "save_checkpoint", save_with_ctrl_c)
    with pytest.raises(Interrupted, match=r"^stopped at step 2 by Ctrl-C"):
        train(quick_config(tmp_path, trainer={"total_steps": 3}, checkpoint={"save_every": 1}))
    assert "Ctrl-C: stopping after step 2 (its checkpoint is saved then)" in capsys.readouterr().err


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, monkeypatch):
    _ctrl_c_during(monkeypatch, 2, times=2)
    with pytest.raises(Interrupted, match=r"stopped by Ctrl-C during step 2, without a checkpoint of it; the newest "
                                          r"checkpoint is \S+step_00000001; resume with --checkpoint.resume auto"):
        train(quick_config(tmp_path, trainer={"total_steps": 3}))
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
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env(),
                                cwd=ROOT)
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


def _sigterm_at_call(monkeypatch, target: int | None) -> list[int]:
    """Count the calls of flashdapo's own functions while `setup_run` runs; at call number `target` (None:
    never) send this process SIGTERM. Returns [calls counted]."""
    from flashdapo.trainer import setup as run_module

    package = str(Path(run_module.__file__).parents[1])
    calls = [0]
    real = run_module.setup_run

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls[0] += 1
            if calls[0] == target:
                sys.setprofile(None)
                os.kill(os.getpid(), signal.SIGTERM)

    def setup_with_profile(*args, **kwargs):
        sys.setprofile(profile)
        try:
            return real(*args, **kwargs)
        finally:
            sys.setprofile(None)

    monkeypatch.setattr(loop, "setup_run", setup_with_profile)
    return calls


def _assert_stopped_in_setup(run_dir, info) -> None:
    assert info.value.exit_status == 143 and "stopped by SIGTERM during setup" in str(info.value), info.value
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text()  # not one step trained
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").iterdir())
    claim_run_dir(run_dir, resume="auto", move_old_run=False).release()  # the lock was released


def test_sigterm_at_any_point_of_setup_stops_before_the_first_step(tmp_path, monkeypatch):
    """SIGTERM at 12 points spread over the whole setup (the k-th call of a flashdapo function, from the
    process group to the rollout engine and the run record): every time the run stops with Interrupted
    before its first step, never trains on."""
    quick = {"trainer": {"total_steps": 1, "val_before_train": False}, "checkpoint": {"export_hf": False}}
    calls = _sigterm_at_call(monkeypatch, None)
    train(quick_config(tmp_path / "count", **quick))
    total = calls[0]
    assert total > 100, total
    for k in sorted({1, 2, 3, *(total * i // 10 for i in range(1, 10)), total}):
        run_dir = tmp_path / f"at-{k}"
        _sigterm_at_call(monkeypatch, k)
        with pytest.raises(Interrupted) as info:
            train(quick_config(run_dir, **quick))
        _assert_stopped_in_setup(run_dir, info)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


class _SignalsWhenCollected:
    """An object whose finalizer receives SIGTERM, as a process-group object being collected during setup
    did: a handler that raised would raise inside __del__, where Python prints 'Exception ignored' and goes on."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_inside_a_finalizer_during_setup_still_stops(tmp_path, monkeypatch, capsys):
    from flashdapo.trainer import setup as run_module

    real = run_module.build_datasets

    def datasets_then_collect(*args, **kwargs):
        _SignalsWhenCollected()  # collected at once: the signal arrives inside its __del__
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, "build_datasets", datasets_then_collect)
    with pytest.raises(Interrupted) as info:
        train(quick_config(tmp_path, trainer={"total_steps": 1, "val_before_train": False}))
    _assert_stopped_in_setup(tmp_path, info)
    assert "Exception ignored" not in capsys.readouterr().err

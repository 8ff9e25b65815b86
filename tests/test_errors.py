"""Errors a user can cause come out as one line naming the place, with a non-zero exit status and no
traceback; --debug or FLASHDAPO_DEBUG=1 shows the traceback instead; under torchrun one rank prints it."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashdapo.__main__ import main
from flashdapo.data import DataError

ROOT = Path(__file__).resolve().parents[1]


_DATA = ["--data.train-files", "d.jsonl"]  # a model needs data files (checked after the model directory)


def _empty_model(tmp):
    (tmp / "model").mkdir()
    return ["train", "--model.path", str(tmp / "model"), *_DATA], 1, f"model.path={tmp / 'model'}: the directory is empty"


def _model_without_config(tmp):
    (tmp / "model").mkdir()
    (tmp / "model" / "model.safetensors").write_bytes(b"")
    return ["train", "--model.path", str(tmp / "model"), *_DATA], 1, "model: no config.json"


def _corrupt_safetensors(tmp):
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp / "model" / "tokenizer.json").write_text("{}")
    (tmp / "model" / "model-00002-of-00002.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": ")
    return (["train", "--model.path", str(tmp / "model"), *_DATA], 1,
            f"{tmp / 'model' / 'model-00002-of-00002.safetensors'}: not a readable safetensors file")


def _missing_data(tmp):
    return ["train", "--data.train-files", str(tmp / "absent.jsonl")], 1, f"{tmp / 'absent.jsonl'}: no such file"


def _bad_data_row(tmp):
    (tmp / "d.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    return ["train", "--data.train-files", str(tmp / "d.jsonl")], 1, f"{tmp / 'd.jsonl'}: row 1 (0-based)"


def _missing_checkpoint(tmp):
    return ["train", "--checkpoint.resume", str(tmp / "nope")], 1, f"checkpoint.resume={tmp / 'nope'}: no such directory"


def _run_dir_is_a_file(tmp):
    (tmp / "run").write_text("x")
    return ["train"], 1, f"logging.run_dir={tmp / 'run'} is a file, not a directory"


def _run_dir_of_another_run(tmp):
    (tmp / "run").mkdir()
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    return ["train"], 1, f"logging.run_dir={tmp / 'run'} holds a previous run (metrics.jsonl)"


def _run_dir_cannot_be_created(tmp):
    return ["train", "--logging.run-dir", "/proc/flashdapo-run"], 1, "logging.run_dir=/proc/flashdapo-run: cannot create"


def _bad_config_value(tmp):
    return ["train", "--optim.lr", "inf"], 2, "optim.lr: expected a finite number"


def _config_file_with_a_section_twice(tmp):
    (tmp / "c.yaml").write_text("optim:\n  lr: 1.0e-5\ntrainer:\n  seed: 1\noptim:\n  lr: 2.0e-5\n")
    return (["train", "--config", str(tmp / "c.yaml")], 2,
            f"--config {tmp / 'c.yaml'}: line 5: key 'optim' appears twice (first at line 1)")


def _bad_eval_argument(tmp):
    (tmp / "model").mkdir()
    (tmp / "d.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    return (["eval", "--model", str(tmp / "model"), "--data", str(tmp / "d.jsonl"), "--out", str(tmp / "o"),
             "--k", "0"], 2, "eval.k: expected >= 1")


def _eval_on_an_empty_model_dir(tmp):
    (tmp / "model").mkdir()
    (tmp / "d.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    return (["eval", "--model", str(tmp / "model"), "--data", str(tmp / "d.jsonl"), "--out", str(tmp / "o")], 1,
            f"--model={tmp / 'model'}: the directory is empty")


CASES = [_empty_model, _model_without_config, _corrupt_safetensors, _missing_data, _bad_data_row,
         _missing_checkpoint, _run_dir_is_a_file, _run_dir_of_another_run, _run_dir_cannot_be_created,
         _bad_config_value, _config_file_with_a_section_twice, _bad_eval_argument, _eval_on_an_empty_model_dir]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_user_errors_are_one_line_naming_the_place(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHDAPO_DEBUG", "0")
    argv, status, place = case(tmp_path)
    if argv[0] == "train":
        argv = [*argv, "--model.toy.sft-steps", "0"]
        if "--logging.run-dir" not in argv:
            argv += ["--logging.run-dir", str(tmp_path / "run")]
    assert main(argv) == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("flashdapo: error: " if status == 1 else "flashdapo: config error: ") and place in err, err


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(tmp_path, monkeypatch, how):
    monkeypatch.setenv("FLASHDAPO_DEBUG", "1" if how == "env" else "0")
    argv = ["train", "--data.train-files", str(tmp_path / "absent.jsonl"), "--logging.run-dir", str(tmp_path / "run")]
    with pytest.raises(DataError, match="no such file"):
        main([*argv, "--debug"] if how == "flag" else argv)


@pytest.mark.distributed
def test_under_torchrun_one_rank_prints_the_error(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", FLASHDAPO_DEBUG="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "flashdapo",
           "train", "--data.train-files", str(tmp_path / "absent.jsonl"), "--logging.run-dir", str(tmp_path / "run"),
           "--trainer.train-batch", "4", "--trainer.gen-batch", "4", "--trainer.mini-batch", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "flashdapo: error:" in line]
    assert len(lines) == 1 and "absent.jsonl: no such file" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + "".join(
        line for line in proc.stderr.splitlines(True) if "[rank" in line)


def test_a_disk_error_is_one_line_naming_the_file_and_a_bug_is_not_hidden():
    from flashdapo.errors import user_error_line

    full = OSError(errno.ENOSPC, "No space left on device", "/runs/a/metrics.jsonl")
    assert user_error_line(full) == ("flashdapo: error: /runs/a/metrics.jsonl: No space left on device; free disk "
                                     "space or fix the permissions, then resume with --checkpoint.resume auto")
    assert user_error_line(KeyError("x")) is None and user_error_line(OSError(errno.ENOSPC, "no file")) is None


def test_a_denied_permission_is_named_as_such():
    from flashdapo.errors import user_error_line

    denied = PermissionError(errno.EACCES, "Permission denied", "/data/train.parquet")
    line = user_error_line(denied)
    assert line.startswith("flashdapo: error: /data/train.parquet: permission denied (Permission denied): the user "
                           "running flashdapo may not access it; fix its permissions") and "disk space" not in line


def _without_read_permission(cmd: list[str]) -> list[str]:
    """`cmd` run so that a file without read permission cannot be read: as is for a normal user; for root
    (whom permissions do not stop) with the capabilities that override them dropped; skipped if neither."""
    if os.geteuid() != 0:
        return cmd
    import shutil

    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a file unreadable")
    drop = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *cmd]


def test_unreadable_weights_are_a_denied_permission_not_a_missing_file(tmp_path):
    """safetensors reports a weight file it may not read as 'No such file or directory': the model check
    names the denied permission instead."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (model / "tokenizer.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b" " * 14)
    weights.chmod(0)
    (tmp_path / "d.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    cmd = _without_read_permission([sys.executable, "-m", "flashdapo", "eval", "--model", str(model), "--data",
                                    str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "o")])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLASHDAPO_DEBUG": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("flashdapo:")]
    assert proc.returncode == 1 and lines == [f"flashdapo: error: {weights}: permission denied: the user running "
                                              "flashdapo may not read it; fix its permissions (e.g. chmod a+r, a+x "
                                              "for a directory) or ownership"], proc.stderr[-3000:]

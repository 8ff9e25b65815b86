"""Where eval and generate write: a full disk while samples.jsonl grows (one line naming it, the file cut back
so it never ends in a torn line, a rerun resumes), and `generate --out` checked before any sampling (a
directory, a file in the way of its folder, a path it may not write: one line each, nothing sampled)."""

from __future__ import annotations

import errno
import json
import resource

import pytest

from flashdapo.__main__ import main as cli
from flashdapo.eval import generate, store
from flashdapo.eval.results import PromptResult, SampleResult
from flashdapo.eval.store import EvalStoreError, SampleLog
from tests.evaluation.toy_export import toy_export


def result(prompt_id: int, text: str = "x" * 200) -> PromptResult:
    return PromptResult(prompt_id=prompt_id, source=f"data.jsonl:{prompt_id}", data_source="toy", ground_truth="1",
                        samples=[SampleResult(response=text, pred="", score=-1.0, acc=False, length=3,
                                              finish_reason="length")])


def _log_with_one_prompt(out) -> SampleLog:
    log = SampleLog(out, {"k": 1})
    log.append([result(0)])
    return log


def test_a_full_disk_while_appending_is_one_line_and_leaves_no_torn_line(tmp_path, monkeypatch):
    log = _log_with_one_prompt(tmp_path / "out")
    before = log.path.read_bytes()
    real_write = store.os.write

    def write_until_full(fd, data):  # half the bytes fit, then the disk is full
        if len(data) > 64:
            return real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.os, "write", write_until_full)
    with pytest.raises(EvalStoreError) as info:
        log.append([result(1), result(2)])
    message = str(info.value)
    assert message.startswith(f"{log.path}: cannot append 2 prompt result(s) (No space left on device)")
    assert "rerun the same command" in message and "\n" not in message
    assert log.path.read_bytes() == before  # cut back: no torn last line
    log.close()


def test_a_file_size_limit_while_appending_is_one_line_and_leaves_no_torn_line(tmp_path):
    """A real write that stops part-way (`ulimit -f`: the kernel writes up to the limit, then EFBIG)."""
    log = _log_with_one_prompt(tmp_path / "out")
    before = log.path.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 100, hard))
    try:
        with pytest.raises(EvalStoreError) as info:
            log.append([result(1), result(2)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(info.value).startswith(f"{log.path}: cannot append 2 prompt result(s) (File too large)")
    assert log.path.read_bytes() == before
    log.append([result(1)])  # room again: the file goes on whole
    assert [json.loads(line)["prompt_id"] for line in log.path.read_text().splitlines()] == [0, 1]
    log.close()


def test_metrics_that_cannot_be_written_are_one_line(tmp_path, monkeypatch):
    log = _log_with_one_prompt(tmp_path / "out")

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.os, "fsync", full)
    with pytest.raises(EvalStoreError, match=r"metrics\.json: cannot write it \(No space left on device\)"):
        store._write_atomic(tmp_path / "out" / "metrics.json", "{}")
    assert not (tmp_path / "out" / "metrics.json.tmp").exists()
    log.close()


# ---------------------------------------------------------------------------------------------------
# generate --out


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return toy_export(tmp_path_factory.mktemp("toy") / "export")


def _generate(export, out) -> int:
    return cli(["generate", "--model", str(export), "--prompt", "Compute 2+3.", "--n", "1", "--max-new-tokens", "2",
                "--out", str(out)])


def test_generate_out_a_directory_is_refused_before_sampling(export, tmp_path, capsys):
    assert _generate(export, tmp_path) == 1
    captured = capsys.readouterr()
    assert captured.err == (f"flashdapo: error: --out {tmp_path} is a directory; give a file path for the responses "
                            f"(e.g. {tmp_path / 'responses.jsonl'})\n")
    assert "response 1/1" not in captured.out  # nothing was sampled


def test_generate_out_under_a_file_is_refused_before_sampling(export, tmp_path, capsys):
    in_the_way = tmp_path / "notes.txt"
    in_the_way.write_text("mine")
    assert _generate(export, in_the_way / "sub" / "gen.jsonl") == 1
    captured = capsys.readouterr()
    assert captured.err == (f"flashdapo: error: --out {in_the_way / 'sub' / 'gen.jsonl'}: cannot create it, "
                            f"{in_the_way} is a file, not a directory; choose another path\n")
    assert "response 1/1" not in captured.out and in_the_way.read_text() == "mine"


def test_generate_out_it_may_not_write_is_refused_before_sampling(export, tmp_path, capsys, monkeypatch):
    out = tmp_path / "gen.jsonl"

    def denied(path, *_args, **_kwargs):  # as a read-only directory answers (root would not be refused)
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(generate, "open", denied, raising=False)
    assert _generate(export, out) == 1
    captured = capsys.readouterr()
    assert captured.err == (f"flashdapo: error: --out {out}: cannot write it (Permission denied); fix its permissions "
                            "or choose another path\n")
    assert "response 1/1" not in captured.out


def test_generate_out_in_a_new_folder_is_created_and_written(export, tmp_path, capsys):
    out = tmp_path / "new" / "gen.jsonl"
    assert _generate(export, out) == 0
    assert len(out.read_text().splitlines()) == 1 and f"written to {out}" in capsys.readouterr().out

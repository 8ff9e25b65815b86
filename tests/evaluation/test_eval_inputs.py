"""Inputs of `flashdapo eval` and `flashdapo generate` that used to pass silently: the same data file given twice
(every problem counted twice) is refused in one line; a prompt longer than --max-prompt-length is cut as
training cuts it, with a warning naming its length and the limit."""

from __future__ import annotations

import pytest

from flashdapo.__main__ import main as cli
from tests.evaluation.toy_export import toy_export


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return toy_export(tmp_path_factory.mktemp("toy") / "export")


@pytest.mark.parametrize("second", ["{data}", "{dir}/./d.jsonl"])
def test_the_same_data_file_twice_is_refused_before_the_model_loads(tmp_path, capsys, second):
    data = tmp_path / "d.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    again = second.format(data=data, dir=tmp_path)
    assert cli(["eval", "--model", str(tmp_path), "--data", str(data), again, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"flashdapo: config error: eval.data: expected each file once (one given twice would count its "
                   f"problems twice), got {[str(data), again]!r}\n")
    assert not (tmp_path / "out").exists()


def test_an_over_long_typed_prompt_is_cut_with_a_warning_naming_its_length_and_the_limit(export, capsys):
    prompt = "Compute " + " + ".join(["7"] * 300) + "."
    assert cli(["generate", "--model", str(export), "--prompt", prompt, "Compute 2+3.", "--n", "1",
                "--max-new-tokens", "2", "--max-prompt-length", "64"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "--max-prompt-length" in line]
    assert len(lines) == 1, lines  # one line, for the long prompt alone
    assert lines[0].startswith("flashdapo: warning: --prompt 0: the prompt has ") and \
        "more than --max-prompt-length 64: only its last 64 are sampled from" in lines[0]
    length = int(lines[0].split("the prompt has ")[1].split(" tokens")[0].replace(",", ""))
    assert length > 600

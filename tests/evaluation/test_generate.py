"""`flashdapo generate` on a toy export: responses printed with the verifier's verdicts, the jsonl, the same
samples as `flashdapo eval` draws, the shipped examples, and one-line refusals."""

from __future__ import annotations

import json
import re

import pytest

from flashdapo.__main__ import main as cli
from flashdapo.config import ToyTaskConfig
from flashdapo.eval.examples import EXAMPLES
from flashdapo.reward import dapo_verify
from flashdapo.tasks.toy import toy_records
from tests.evaluation.toy_export import toy_export

SAMPLING = ["--n", "3", "--max-new-tokens", "6", "--seed", "5"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return toy_export(tmp_path_factory.mktemp("toy") / "export")


def verdicts(out: str) -> list[str]:
    """Each printed response's verdict ('' where none is printed), in order."""
    return [m.group(1) or "" for m in re.finditer(r"^  response \d+/\d+ \(\d+ tokens, \w+\)(?:: (\w+))?", out, re.M)]


def test_data_prompts_print_with_verdicts_write_jsonl_and_sample_as_eval_does(export, tmp_path, capsys):
    records = toy_records(ToyTaskConfig(num_val=3), "val")
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"prompt": r.messages, "reward_model": {"ground_truth": r.ground_truth}})
                            + "\n" for r in records))
    out = tmp_path / "gen.jsonl"
    assert cli(["generate", "--model", str(export), "--data", str(data), "--limit", "2", *SAMPLING,
                "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["ground_truth"] for r in rows] == [r.ground_truth for r in records[:2]]
    samples = [s for r in rows for s in r["samples"]]
    assert len(samples) == 6
    # Each verdict is the verifier's on that response, printed as written.
    for row in rows:
        for s in row["samples"]:
            assert dapo_verify(s["response"], row["ground_truth"]).acc == s["acc"]
    assert verdicts(printed) == ["correct" if s["acc"] else "wrong" for s in samples]
    assert f"ground truth: {records[0].ground_truth}" in printed and f"written to {out}" in printed
    # eval's path with the same sampling draws the same responses.
    # eval refuses a budget past the model's 2048 positions (the default prompt budget is 2048).
    assert cli(["eval", "--model", str(export), "--data", str(data), "--out", str(tmp_path / "eval"), "--k", "3",
                "--max-new-tokens", "6", "--seed", "5", "--no-progress", "--max-prompt-length", "256"]) == 0
    evaluated = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [s["response"] for r in evaluated[:2] for s in r["samples"]] == [s["response"] for s in samples]


def test_typed_prompts_have_no_verdict_and_the_examples_have_answers(export, capsys):
    assert cli(["generate", "--model", str(export), "--prompt", "Compute 2+3.", "Compute 4+4.", "--n", "2",
                "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert verdicts(printed) == [""] * 4 and "no ground truth, no verdicts" in printed
    assert cli(["generate", "--model", str(export), "--examples", "--n", "1", "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    for i, (_, answer) in enumerate(EXAMPLES):
        assert f"[{i + 1}] examples:{i}  ground truth: {answer}" in printed
    assert set(verdicts(printed)) <= {"correct", "wrong"} and len(verdicts(printed)) == len(EXAMPLES)


@pytest.mark.parametrize(("flags", "message"), [
    (["--model", "missing-dir", "--examples"], "generate.model: expected an existing model directory (e.g. "
                                              "runs/toy/export), got 'missing-dir'"),
    (["--examples"], "generate.model: expected an existing model directory (e.g. runs/toy/export), got ''"),
    (["--model", "{export}", "--prompt", " "], "generate.prompt: expected prompts with text, got [' ']"),
    (["--model", "{export}"], "generate.prompt: expected exactly one source of prompts: --prompt TEXT [TEXT ...], "
                              "--data FILE or --examples, got []"),
])
def test_a_missing_model_or_an_empty_prompt_is_refused_in_one_line(export, capsys, flags, message):
    assert cli(["generate", *[f.format(export=export) for f in flags]]) == 2
    assert capsys.readouterr().err == f"flashdapo: config error: {message}\n"

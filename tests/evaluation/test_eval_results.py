"""Evaluation metrics: unbiased pass@k against enumeration, maj@k and its tie rule, per-source reports."""

from __future__ import annotations

import itertools
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashdapo.config import DataConfig, ToyTaskConfig
from flashdapo.data import DAPO_TEMPLATE, load_prompts
from flashdapo.eval.results import (
    PromptResult,
    SampleResult,
    maj_at_k,
    majority_answer,
    pass_at_k,
    reported_ks,
    summarize,
)
from flashdapo.tasks.toy import build_toy_tokenizer


def sample(acc: bool, pred: str = "", length: int = 3, finish: str = "stop") -> SampleResult:
    return SampleResult(response=f"Answer: {pred}", pred=pred, score=1.0 if acc else -1.0, acc=acc,
                        length=length, finish_reason=finish)


def prompt(pid: int, source: str, samples: list[SampleResult]) -> PromptResult:
    return PromptResult(prompt_id=pid, source=f"f:{pid}", data_source=source, ground_truth="1", samples=samples)


def brute_pass_at_k(correct: list[bool], k: int) -> float:
    """Fraction of the k-subsets of the samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


def test_unbiased_pass_at_k_equals_enumeration():
    rng = random.Random(1234)
    for _ in range(40):
        n = rng.randint(1, 9)
        correct = [rng.random() < rng.random() for _ in range(n)]
        for k in range(1, n + 1):
            assert pass_at_k(n, sum(correct), k) == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12)


def test_pass_at_k_edges_and_bias():
    assert pass_at_k(32, 0, 32) == 0.0 and pass_at_k(32, 32, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 is the mean accuracy
    # One correct of 32: the first-k estimate is 0 for every k when it is last; the unbiased one is k/32.
    assert pass_at_k(32, 1, 8) == pytest.approx(8 / 32)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_ties_go_to_the_answer_seen_first():
    assert majority_answer(["3", "2", "2", "3"]) == "3"
    assert majority_answer(["2", "3", "3", "2"]) == "2"
    assert majority_answer(["", "", "5"]) == "5"  # empty extractions do not vote
    assert majority_answer(["", ""]) is None
    # Same multiset, other order: the winner follows the order, deterministically.
    right_first = [sample(True, "2"), sample(False, "3")]
    assert maj_at_k(right_first, 2) == 1.0 and maj_at_k(right_first[::-1], 2) == 0.0


def test_maj_at_k_blocks():
    samples = [sample(True, "7"), sample(False, "4"), sample(False, "4"), sample(True, "7"),
               sample(True, "7"), sample(False, "")]
    assert maj_at_k(samples, 1) == pytest.approx(3 / 6)  # each sample alone; "" never wins
    assert maj_at_k(samples, 2) == pytest.approx(2 / 3)  # blocks (7,4) (4,7) (7,-): 7, 4, 7
    assert maj_at_k(samples, 3) == pytest.approx(1 / 2)  # (7,4,4) -> 4 wrong; (7,7,-) -> 7 right
    assert maj_at_k(samples, 4) == 1.0  # one block (7,4,4,7): a 2-2 tie, 7 is seen first and right
    assert maj_at_k(samples[1:5], 4) == 0.0  # (4,4,7,7): the same tie, 4 first and wrong


def test_reported_ks():
    assert reported_ks(32) == [1, 2, 4, 8, 16] and reported_ks(1) == [] and reported_ks(6) == [1, 2, 4]


def test_summary_per_source_and_pooled():
    a = [prompt(0, "aime", [sample(True, "1"), sample(False, "2")]),
         prompt(2, "aime", [sample(False, "2"), sample(False, "", finish="length", length=9)])]
    b = [prompt(1, "math", [sample(True, "1"), sample(True, "1")])]
    report = summarize(a + b)
    assert [s.source for s in report.sources] == ["aime", "math"]
    aime, math = report.sources
    assert aime.prompts == 2 and aime.mean == pytest.approx(0.25) and aime.pass_at[2] == pytest.approx(0.5)
    assert aime.truncated == pytest.approx(0.25) and aime.response_length == pytest.approx(18 / 4)
    assert math.mean == 1.0 and math.maj_at[2] == 1.0
    assert report.pooled.prompts == 3 and report.pooled.mean == pytest.approx(3 / 6)
    assert report.pooled.pass_at[1] == pytest.approx(report.pooled.mean)
    m = report.metrics("val")
    assert m["val/aime/acc/mean@k"] == pytest.approx(0.25) and m["val/math/acc/pass@k"] == 1.0
    assert m["val/acc/mean@k"] == pytest.approx(0.5) and m["val/aime/acc/pass@1"] == pytest.approx(0.25)
    assert m["val/k"] == 2.0 and m["val/aime/response_length/clip_ratio"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="same n"):
        summarize(a + [prompt(5, "math", [sample(True, "1")])])


def test_sources_from_column_and_file_name(tmp_path):
    """Two sources in one parquet (data_source column) and a third from a jsonl's file name."""
    def row(problem: str, source: str) -> dict:
        return {"data_source": source, "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=problem)}],
                "ability": "MATH", "reward_model": {"ground_truth": "3", "style": "rule"}}
    rows = [row("1+2", "aime24"), row("2+1", "math500"), row("1+2", "aime24"), row("0+3", "math500")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mixed.parquet")
    (tmp_path / "extra.jsonl").write_text('{"problem": "4-1", "answer": "3"}\n')
    tok = build_toy_tokenizer(ToyTaskConfig())
    data = load_prompts([str(tmp_path / "mixed.parquet"), str(tmp_path / "extra.jsonl")], tok,
                        DataConfig(dedup=True))
    assert [p.data_source for p in data.prompts] == ["aime24", "math500", "math500", "extra"]
    results = [prompt(i, p.data_source, [sample(i % 2 == 0, "3"), sample(False, "4")])
               for i, p in enumerate(data.prompts)]
    report = summarize(results)
    assert {s.source: s.prompts for s in report.sources} == {"aime24": 1, "extra": 1, "math500": 2}
    assert {s.source: s.mean for s in report.sources} == {"aime24": 0.5, "extra": 0.0, "math500": 0.25}

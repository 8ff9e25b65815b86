"""The scratchpad task: problems, worked answers, verifier agreement, lengths against the preset's limit, and
what its warmed-up base does (truncation and all-equal groups)."""

from __future__ import annotations

import random

import pytest

from flashdapo.config import ConfigError, ScratchpadTaskConfig, merge, preset
from flashdapo.reward import get_verifier
from flashdapo.tasks import build_datasets, task_records
from flashdapo.tasks.scratchpad import (
    SCRATCHPAD_DATA_SOURCE,
    build_scratchpad_tokenizer,
    scratchpad_problems,
    scratchpad_records,
    scratchpad_sft_examples,
    worked_answer,
)

PRESET = preset("scratchpad")


def test_every_problem_reference_answer_verifies():
    cfg = PRESET.data.scratchpad
    verify = get_verifier("dapo")
    train, val = scratchpad_problems(cfg)
    records = scratchpad_records(cfg, "train") + scratchpad_records(cfg, "val")
    assert len(records) == cfg.num_train + cfg.num_val
    for (a, b), record in zip(train + val, records, strict=True):
        assert record.ground_truth == str(a + b) and record.data_source == SCRATCHPAD_DATA_SOURCE
        assert f"{a}+{b}" in record.messages[0]["content"]
        for verbose in (False, True):
            worked = worked_answer(a, b, verbose=verbose)
            assert worked.answer == a + b
            assert verify(worked.text, record.ground_truth).acc, (a, b, worked.text)


def test_split_is_held_out_deterministic_and_spans_the_digit_counts():
    cfg = ScratchpadTaskConfig(num_train=500, num_val=50, max_digits=3, seed=3)
    train, val = scratchpad_problems(cfg)
    assert (train, val) == scratchpad_problems(cfg)
    assert len(set(train)) == 500 and len(set(val)) == 50 and not set(train) & set(val)
    assert {len(str(a)) for a, _ in train} == {1, 2, 3}
    assert all(len(str(a)) == len(str(b)) for a, b in train + val)
    assert scratchpad_problems(ScratchpadTaskConfig(num_train=500, num_val=50, max_digits=3, seed=4)) != (train, val)
    with pytest.raises(ConfigError, match="data.scratchpad.num_train"):
        scratchpad_problems(ScratchpadTaskConfig(num_train=100, num_val=1, max_digits=1))  # 100 problems only
    with pytest.raises(ConfigError, match="data.scratchpad.max_digits"):
        ScratchpadTaskConfig(min_digits=3, max_digits=2)


def test_worked_answer_columns_carries_and_slips():
    worked = worked_answer(482, 193)
    assert worked.text == "2+3=5\n8+9=17\n4+1+1=6\nAnswer: 675"
    slipped = worked_answer(482, 193, slips=frozenset({1}), slip_sign=1)  # 8+9 written as 18
    assert slipped.text == "2+3=5\n8+9=18\n4+1+1=6\nAnswer: 685" and slipped.answer != 482 + 193
    assert not get_verifier("dapo")(slipped.text, "675").acc
    # 9+9+1=19 is the top a column can write: a slip up goes down instead.
    assert worked_answer(99, 99, slips=frozenset({1}), slip_sign=1).text == "9+9=18\n9+9+1=18\nAnswer: 188"
    long_hand = worked_answer(95, 17, verbose=True).text
    assert long_hand.splitlines()[0] == "95+17:" and "write 2, carry 1" in long_hand


def test_warmup_examples_slip_and_go_long_hand_at_the_configured_rates():
    cfg = ScratchpadTaskConfig(num_train=300, num_val=20, max_digits=3, slip_fraction=0.2, verbose_fraction=0.4)
    examples = scratchpad_sft_examples(cfg, 1500, random.Random(0))
    assert examples == scratchpad_sft_examples(cfg, 1500, random.Random(0))
    val_prompts = {r.messages[0]["content"] for r in scratchpad_records(cfg, "val")}
    verify = get_verifier("dapo")
    verbose = sum(text.splitlines()[0].endswith(":") for _, text in examples) / len(examples)
    right_by_digits: dict[int, list[bool]] = {}
    for record, text in examples:
        assert record.messages[0]["content"] not in val_prompts
        digits = len(record.messages[0]["content"].removeprefix("Add ").split("+")[0])
        right_by_digits.setdefault(digits, []).append(verify(text, record.ground_truth).acc)
    assert 0.35 < verbose < 0.45
    rates = [sum(v) / len(v) for _, v in sorted(right_by_digits.items())]
    assert rates == sorted(rates, reverse=True) and rates[0] > 0.7 > rates[-1], rates


def test_lengths_against_the_presets_limit():
    """By design: every compact answer fits below the soft-punishment buffer; long-hand ones of 2+ digits do not
    fit the limit at all (the warmed-up base, which writes some long-hand, gets truncated)."""
    cfg = PRESET.data.scratchpad
    tok = build_scratchpad_tokenizer(cfg)
    limit, buffer = PRESET.rollout.max_response_length, PRESET.algorithm.overlong_buffer_len
    train, val = scratchpad_problems(cfg)
    compact = verbose_long = 0
    for a, b in train + val:
        compact = max(compact, len(tok.encode(worked_answer(a, b).text)) + 1)  # + EOS
        if len(str(a)) >= 2:
            verbose_long = min(verbose_long or 10**9, len(tok.encode(worked_answer(a, b, verbose=True).text)) + 1)
    print(f"longest compact answer {compact} tokens; shortest long-hand answer of 2+ digits {verbose_long}; "
          f"limit {limit}, free up to {limit - buffer}")
    assert compact <= limit - buffer < limit < verbose_long


def test_build_datasets_picks_the_task():
    data = merge(PRESET, {"data": {"scratchpad": {"num_train": 40, "num_val": 8}}}).data
    tok = build_scratchpad_tokenizer(data.scratchpad)
    train, val = build_datasets(data, tok)
    assert len(train) == 40 and val is not None and len(val) == 8
    assert [p.ground_truth for p in val.prompts] == [r.ground_truth for r in task_records(data, "val")]


@pytest.mark.slow
def test_warmed_up_base_truncates_and_makes_all_equal_groups(tmp_path):
    """The preset's own warm-up: its base must give the ladder something to act on. Its figures depend on the
    CPU that warms it up (docs/ablation.md, "Numbers belong to a machine"): measured all-equal share of groups
    0.33 on an AMD EPYC, 0.156 on an Intel Xeon (accuracy 0.244 / 0.299, truncated 0.277 / 0.258), so the bar
    is "clearly some" (7 or more of the 64 groups), not one machine's value."""
    from flashdapo.ablation.base import base_statistics, build_base

    assert build_base(PRESET, tmp_path / "base", log=print)
    stats = base_statistics(PRESET, tmp_path / "base", prompts=64)
    print(f"warmed-up base: {stats.summary()}")
    assert stats.truncated > 0.02
    assert stats.all_right + stats.all_wrong > 0.1
    assert 0 < stats.accuracy < 0.9
    assert not build_base(PRESET, tmp_path / "base", log=print)  # same settings: reused


def test_long_hand_slip_chance_of_its_own():
    cfg = ScratchpadTaskConfig(num_train=300, num_val=20, max_digits=2, slip_fraction=0.3, verbose_fraction=0.4)
    examples = scratchpad_sft_examples(cfg, 600, random.Random(1))
    # Unset, long-hand work slips like compact work: the same examples as setting it to slip_fraction.
    same = ScratchpadTaskConfig(**{**cfg.__dict__, "verbose_slip_fraction": 0.3})
    assert scratchpad_sft_examples(same, 600, random.Random(1)) == examples
    careful = ScratchpadTaskConfig(**{**cfg.__dict__, "verbose_slip_fraction": 0.0})
    verify = get_verifier("dapo")
    right = {True: [], False: []}
    for record, text in scratchpad_sft_examples(careful, 600, random.Random(1)):
        right[text.splitlines()[0].endswith(":")].append(verify(text, record.ground_truth).acc)
    assert all(right[True]) and len(right[True]) > 150  # long-hand never slips: longer work is more often right
    assert 0.4 < sum(right[False]) / len(right[False]) < 0.9

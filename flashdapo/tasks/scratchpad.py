"""The built-in scratchpad task: multi-digit addition worked out column by column, then the answer.

It is the task of `flashdapo ablate` (docs/ablation.md), built so that each DAPO technique has
something to act on:
- **Written work decides correctness.** "Add 4823+1937. Work column by column, then end with Answer: N";
  a worked answer writes one line per column, right to left, each with its carry ("3+7=10",
  "2+3+1=6", ...), then "Answer: 6760". The answer follows from the written column sums.
- **Lengths vary and the limit binds.** Operands have 1..max_digits digits (2 in the scratchpad preset),
  so compact answers take 13 to 23 tokens there; the long-hand style of some demonstrations (the problem
  restated, every column's digit and carry spelled out) takes 32 to 57, past the preset's 40-token limit
  for two digits, so the warmed-up base truncates some responses.
- **The base is right on some problems some of the time.** The warm-up demonstrations slip (a column sum
  off by one) with probability `slip_fraction` per column, so short problems are usually right and long
  ones rarely: many groups are all right or all wrong, and on long problems right answers are rare.
- **Validation is held out**: its problems never occur in training (generalization, not memorization).

Problems are deterministic in `data.scratchpad.seed`; the tokenizer is the toy's kind (toy.py) trained
on this task's text; the model is the built-in Qwen2 of `model.toy`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from transformers import PreTrainedTokenizerFast

from ..config import ConfigError, ScratchpadTaskConfig, field_path
from ..data import Record
from .toy import TOY_VOCAB_SIZE, train_chat_tokenizer

SCRATCHPAD_DATA_SOURCE = "scratchpad_addition"

Problem = tuple[int, int]


# ---------------------------------------------------------------------------------------------------
# Problems and records


def _operand_range(digits: int) -> range:
    return range(10) if digits == 1 else range(10 ** (digits - 1), 10**digits)


def _capacity(cfg: ScratchpadTaskConfig) -> dict[int, int]:
    return {d: len(_operand_range(d)) ** 2 for d in range(cfg.min_digits, cfg.max_digits + 1)}


def scratchpad_problems(cfg: ScratchpadTaskConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, val): distinct (a, b) pairs, both operands of the same digit count, drawn uniformly from
    min_digits..max_digits (a count whose pairs are used up is drawn no more); val is disjoint from train."""
    capacity = _capacity(cfg)
    wanted = cfg.num_train + cfg.num_val
    if wanted > sum(capacity.values()):
        raise ConfigError(
            f"{field_path(ScratchpadTaskConfig, 'num_train')}: num_train + num_val = {wanted} exceeds "
            f"the {sum(capacity.values())} distinct problems of {cfg.min_digits}..{cfg.max_digits} "
            "digits; lower them or raise data.scratchpad.max_digits")
    rng = random.Random(cfg.seed)
    seen: dict[int, set[Problem]] = {d: set() for d in capacity}
    ordered: list[Problem] = []
    open_counts = sorted(capacity)
    while len(ordered) < wanted:
        digits = rng.choice(open_counts)
        operands = _operand_range(digits)
        problem = (rng.choice(operands), rng.choice(operands))
        if problem in seen[digits]:
            continue
        seen[digits].add(problem)
        ordered.append(problem)
        if len(seen[digits]) == capacity[digits]:
            open_counts.remove(digits)
    return ordered[cfg.num_val:], ordered[:cfg.num_val]


def _record(problem: Problem, cfg: ScratchpadTaskConfig, source: str) -> Record:
    a, b = problem
    content = cfg.prompt_format.format(a=a, b=b)
    return Record([{"role": "user", "content": content}], str(a + b), source, SCRATCHPAD_DATA_SOURCE)


def scratchpad_records(cfg: ScratchpadTaskConfig, split: Literal["train", "val"]) -> list[Record]:
    """The task's records for `split`; train and val are disjoint, both deterministic in cfg.seed."""
    if split not in ("train", "val"):
        raise ValueError(f"scratchpad_records: split must be 'train' or 'val', got {split!r}")
    train, val = scratchpad_problems(cfg)
    problems = train if split == "train" else val
    return [_record(p, cfg, f"scratchpad:{split}:{i}") for i, p in enumerate(problems)]


# ---------------------------------------------------------------------------------------------------
# Worked answers (the warm-up demonstrations)


@dataclass(frozen=True)
class WorkedAnswer:
    """A written solution and the answer its written work leads to (wrong where a column slipped)."""

    text: str
    answer: int


def worked_answer(a: int, b: int, *, verbose: bool = False, slips: frozenset[int] = frozenset(),
                  slip_sign: int = 1) -> WorkedAnswer:
    """Column-by-column addition of a + b, right to left. Column k (0 = units) in `slips` writes its sum off
    by `slip_sign` (kept in 0..19); later carries and the answer follow the written sums, as a person's
    would."""
    digits = max(len(str(a)), len(str(b)))
    xs, ys = str(a).zfill(digits)[::-1], str(b).zfill(digits)[::-1]
    lines = [f"{a}+{b}:"] if verbose else []
    carry, out_digits = 0, []
    for k in range(digits):
        x, y = int(xs[k]), int(ys[k])
        total = x + y + carry
        if k in slips:
            total = total + slip_sign if 0 <= total + slip_sign <= 19 else total - slip_sign
        terms = f"{x}+{y}" + (f"+{carry}" if carry or verbose else "")
        line = f"{terms}={total}"
        lines.append(f"column {k + 1}: {line}, write {total % 10}, carry {total // 10}" if verbose else line)
        out_digits.append(str(total % 10))
        carry = total // 10
    if carry:
        out_digits.append(str(carry))
    answer = int("".join(reversed(out_digits)))
    lines.append(f"Answer: {answer}")
    return WorkedAnswer("\n".join(lines), answer)


def scratchpad_sft_examples(cfg: ScratchpadTaskConfig, n: int,
                            rng: random.Random) -> list[tuple[Record, str]]:
    """`n` (prompt record, response) pairs from the train split: compact worked answers, long-hand with
    probability cfg.verbose_fraction, each column slipping with probability cfg.slip_fraction (long-hand ones:
    cfg.verbose_slip_fraction when set)."""
    train, _ = scratchpad_problems(cfg)
    out = []
    for i in range(n):
        a, b = train[rng.randrange(len(train))]
        columns = max(len(str(a)), len(str(b)))
        # drawn before `verbose`: the default's stream unchanged
        draws = [rng.random() for _ in range(columns)]
        verbose = rng.random() < cfg.verbose_fraction
        verbose_slip = verbose and cfg.verbose_slip_fraction is not None
        chance = cfg.verbose_slip_fraction if verbose_slip else cfg.slip_fraction
        slips = frozenset(k for k, u in enumerate(draws) if u < chance)
        worked = worked_answer(a, b, verbose=verbose, slips=slips, slip_sign=rng.choice((-1, 1)))
        out.append((_record((a, b), cfg, f"scratchpad:sft:{i}"), worked.text))
    return out


# ---------------------------------------------------------------------------------------------------
# Tokenizer


def build_scratchpad_tokenizer(cfg: ScratchpadTaskConfig,
                               vocab_size: int = TOY_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """The toy's kind of tokenizer (byte-level BPE, digits split, ChatML) trained on this task's prompts and
    both styles of worked answer; deterministic."""
    train, val = scratchpad_problems(cfg)
    lines = []
    for a, b in (train + val)[:600]:
        lines.append("user\n" + cfg.prompt_format.format(a=a, b=b))
        lines.append("assistant\n" + worked_answer(a, b).text)
        lines.append("assistant\n" + worked_answer(a, b, verbose=True).text)
    return train_chat_tokenizer(lines, vocab_size)

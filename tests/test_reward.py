"""Tests for flashdapo.reward: the DAPO "Answer:" rule as released, and the verifier registry."""

from __future__ import annotations

import dataclasses
import math
import random
import re
import sys
import time

import pytest
import torch

from flashdapo.reward import (
    REMOVED_EXPRESSIONS,
    SUBSTITUTIONS,
    RewardError,
    Verdict,
    check_reward,
    dapo_verify,
    dapo_verl_verify,
    get_verifier,
    last_boxed_content,
    math_verify_verify,
    normalize_final_answer,
    normalize_ground_truth,
    verify_responses,
)

PREAMBLE = "Let me think step by step.\nSo the total is computed below.\n"

# ---------------------------------------------------------------------------------------------
# The consequences docs/algorithm.md (section 4) lists
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "last_line, correct",
    [
        ("Answer: 540", True),
        ("Answer: $540$", True),
        ("Answer: \\boxed{540}", True),
        ("answer:540", True),
        ("ANSWER :  540", True),
        ("Final Answer: 540", True),
        ("Answer: x = 540", True),
        ("Answer: 540 degrees", True),
        ("Answer: 540.", False),
        ("Answer: **540**", False),
        ("**Answer:** 540", False),  # extraction is "** 540"
        ("Answer: 540.0", False),
        ("\\boxed{540}", False),  # no Answer line at all
        ("The answer is 540", False),
    ],
)
def test_dapo_md_consequences(last_line: str, correct: bool) -> None:
    v = dapo_verify(PREAMBLE + last_line, "540")
    assert v.acc is correct
    assert v.score == (1.0 if correct else -1.0)


def test_invalid_response_has_empty_pred() -> None:
    assert dapo_verify("no answer line here, \\boxed{540}", "540") == Verdict(-1.0, False, "")
    assert dapo_verify("", "540") == Verdict(-1.0, False, "")


# ---------------------------------------------------------------------------------------------
# Extraction: window, last match, line end
# ---------------------------------------------------------------------------------------------


def test_only_last_300_chars_are_read() -> None:
    early = "Answer: 540\n" + "x" * 300
    assert dapo_verify(early, "540").pred == ""
    assert not dapo_verify(early, "540").acc


def test_window_boundary() -> None:
    line = "Answer: 540\n"
    inside = line + "y" * (300 - len(line))  # exactly 300 characters: "A" is the first one kept
    assert len(inside) == 300 and dapo_verify(inside, "540").acc
    outside = line + "y" * (301 - len(line))  # the "A" falls out: "nswer:" does not match
    assert dapo_verify(outside, "540") == Verdict(-1.0, False, "")


@pytest.mark.parametrize(
    "response, correct",
    [
        ("Answer: 1\nthen I rechecked.\nAnswer: 540", True),
        ("Answer: 540\nthen I rechecked.\nAnswer: 1", False),
        ("Answer: 540 Answer: 7", False),  # same line: the greedy first match swallows the rest
        ("Answer: 540\nThat is all.", True),  # the match stops at the end of its line
        ("Answer: 540\r\n", True),  # "\r" is kept by [^\n]+ and then stripped
    ],
)
def test_last_match_and_lines(response: str, correct: bool) -> None:
    assert dapo_verify(response, "540").acc is correct


def test_answer_on_next_line() -> None:
    # `\s*` after the colon matches newlines, so an answer on the following line is still found.
    assert dapo_verify("Answer:\n540", "540").acc
    assert dapo_verify("Answer:\n\n  540\n", "540").pred == "540"


# ---------------------------------------------------------------------------------------------
# Normalization, one rule per row
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, normalized",
    [
        # text after the last "="
        ("x = 540", "540"),
        ("a = b = 7", "7"),
        # substitutions: articles, escaped dollars, "\ ", spaces, mbox, \text{and}, \text{m}
        ("an apple", "apple"),
        ("a dog", "dog"),
        ("$540.$", "540"),
        ("\\$540", "540"),
        ("5\\ 000", "5000"),
        (" 1 2 3 ", "123"),
        ("5 \\mbox{ inches}", "5"),
        ("x \\text{ and } y", "x,y"),
        ("x, \\text{and} y", "x,y"),
        ("5\\text{m}", "5"),
        # removed unit words and TeX noise
        ("5 square units", "5"),
        ("10 ways", "10"),
        ("3 integers", "3"),
        ("12 dollars", "12"),
        ("60 mph", "60"),
        ("7 inches", "7"),
        ("2 hours", "2"),
        ("4 km", "4"),
        ("9 points", "9"),
        ("8 feet", "8"),
        ("15 minutes", "15"),
        ("3 digits", "3"),
        ("25 cents", "25"),
        ("540 degrees", "540"),
        ("5 cm", "5"),
        ("5 gm", "5"),
        ("6 pounds", "6"),
        ("100 meters", "100"),
        ("3 meals", "3"),
        ("12 edges", "12"),
        ("30 students", "30"),
        ("4 childrentickets", "4"),
        ("5 multiples", "5"),
        ("sue5", "5"),  # a harness quirk, kept
        ("1, 2, \\ldots, n", "1,2,,n"),
        ("1, 2, \\dots, n", "1,2,,n"),
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("5\\mathrm{th}", "5"),
        ("5\\text{s}", "5"),
        ("5\\text{.}", "5"),
        ("5\\text{}^2", "5"),
        ("5\\text{}^3", "5"),
        ("1\\;000", "1000"),
        ("1,\\!000", "1000"),
        ("1{,}000", "1000"),
        ('"540"', "540"),
        # the inside of the first $...$ (text around it is dropped)
        ("$540$", "540"),
        ("so $540$ total", "540"),
        ("$1$ and $2$", "1"),
        # unwrapping
        ("\\text{(A)}", "(A)"),
        ("\\textbf{(B)}", "(B)"),
        ("\\overline{AB}", "AB"),
        ("\\boxed{540}", "540"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # greedy: up to the last "}"
        # shorthand TeX repair
        ("\\frac12", "\\frac{1}{2}"),
        ("\\frac123", "\\frac{1}{2}3"),
        ("\\frac{12}{5}", "\\frac{12}{5}"),
        ("\\dfrac12", "\\dfrac{1}{2}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("\\sqrt{2}", "\\sqrt{2}"),
        ("3\\sqrt23", "3\\sqrt{2}3"),
        # commas in pure digit strings only
        ("1,000", "1000"),
        ("1,000,000", "1000000"),
        ("1,000.5", "1,000.5"),
        ("(1,2)", "(1,2)"),
        ("1, 2", "12"),  # a digit list collapses: a harness quirk, kept
        ("1 \\text{ and } 2", "12"),
        # what is NOT normalized
        ("540.", "540."),
        ("540.0", "540.0"),
        ("**540**", "**540**"),
        ("-540", "-540"),
    ],
)
def test_normalize_final_answer(raw: str, normalized: str) -> None:
    assert normalize_final_answer(raw) == normalized


def test_rule_lists_are_complete() -> None:
    assert len(SUBSTITUTIONS) == 10
    assert len(REMOVED_EXPRESSIONS) == 41
    assert SUBSTITUTIONS[0] == ("an ", "") and SUBSTITUTIONS[-1] == ("\\text{m}", "\\text{}")
    assert "\\text{\ns}" in REMOVED_EXPRESSIONS and "\\text{\n}" in REMOVED_EXPRESSIONS
    assert REMOVED_EXPRESSIONS[-1] == "\\dots"


# ---------------------------------------------------------------------------------------------
# End to end: prediction vs ground truth, both normalized
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, ground_truth, correct",
    [
        ("1,000", "1000", True),
        ("1000", "1,000", True),
        ("\\frac12", "\\frac{1}{2}", True),
        ("\\frac{1}{2}", "1/2", False),
        ("\\dfrac{1}{2}", "\\frac{1}{2}", False),
        ("0.5", "\\frac{1}{2}", False),
        ("\\sqrt2", "\\sqrt{2}", True),
        ("\\text{(C)}", "(C)", True),
        ("\\textbf{C}", "C", True),
        ("$\\boxed{12}$", "12", True),
        # the ground truth is normalized too
        ("540", "$540$", True),
        ("540", "540 degrees", True),
        ("540", "x = 540", True),
        ("540", " 540 ", True),
        ("540", "\\boxed{540}", True),
    ],
)
def test_prediction_against_ground_truth(answer: str, ground_truth: str, correct: bool) -> None:
    assert dapo_verify(f"{PREAMBLE}Answer: {answer}", ground_truth).acc is correct


def test_pred_is_normalized_extraction() -> None:
    v = dapo_verify(PREAMBLE + "Answer: $x = 1,000$ dollars", "1000")
    assert v == Verdict(score=1.0, acc=True, pred="1000")
    assert dapo_verify(PREAMBLE + "Answer: 541 degrees", "540").pred == "541"


def test_verdict_is_frozen() -> None:
    v = Verdict(1.0, True, "1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.score = -1.0  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Registry and batch scoring
# ---------------------------------------------------------------------------------------------


def test_get_verifier_dapo() -> None:
    assert get_verifier("dapo") is dapo_verify


def test_get_verifier_unknown_lists_names() -> None:
    with pytest.raises(ValueError, match=r"dapo.*math_verify"):
        get_verifier("sympy")


def test_math_verify_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(ImportError, match=r"pip install 'flashdapo\[math\]'"):
        get_verifier("math_verify")
    with pytest.raises(ImportError, match=r"pip install 'flashdapo\[math\]'"):
        math_verify_verify("Answer: 1", "1")


class _CharTokenizer:
    """Token id = character code; ids >= 1000 are special tokens (dropped when asked)."""

    def batch_decode(self, sequences, skip_special_tokens=False):
        return ["".join(chr(t) for t in s if not (skip_special_tokens and t >= 1000)) for s in sequences]


def test_verify_responses_decodes_then_judges() -> None:
    responses = ["Answer: 540", "Answer: 7", "nothing", "Answer: \\frac12"]
    ids = [torch.tensor([ord(c) for c in r] + [1000]) for r in responses]  # an EOS-like special token
    truths = ["540", "540", "540", "\\frac{1}{2}"]
    texts, verdicts = verify_responses(ids, truths, _CharTokenizer(), dapo_verify)
    assert texts == responses
    assert [v.acc for v in verdicts] == [True, False, False, True]
    assert [v.score for v in verdicts] == [1.0, -1.0, -1.0, 1.0]
    assert verify_responses([], [], _CharTokenizer(), dapo_verify) == ([], [])
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        verify_responses([[97], [98]], ["a"], _CharTokenizer(), dapo_verify)


# ---------------------------------------------------------------------------------------------
# math-verify backend (optional extra)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, ground_truth, correct",
    [
        ("Answer: 540", "540", True),
        ("so the result is \\boxed{540}", "540", True),
        ("Answer: $\\frac{1}{2}$", "0.5", True),
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("Answer: 541", "540", False),
        ("I do not know.", "540", False),
    ],
)
def test_math_verify(response: str, ground_truth: str, correct: bool) -> None:
    pytest.importorskip("math_verify")
    verifier = get_verifier("math_verify")
    v = verifier(response, ground_truth)
    assert v.acc is correct
    assert v.score == (1.0 if correct else -1.0)


def test_math_verify_pred() -> None:
    pytest.importorskip("math_verify")
    assert math_verify_verify("Answer: 540", "540").pred == "540"
    assert math_verify_verify("I do not know.", "540").pred == ""


# ---------------------------------------------------------------------------------------------
# Cost: linear normalization, bounded in both arguments
# ---------------------------------------------------------------------------------------------

# The harness's TeX rewrites as it writes them (regexes that backtrack quadratically on long lines).
HARNESS_TEX_REWRITES = (
    (r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$"),
    (r"(\\text\{)(.*?)(\})", r"\2"),
    (r"(\\textbf\{)(.*?)(\})", r"\2"),
    (r"(\\overline\{)(.*?)(\})", r"\2"),
    (r"(\\boxed\{)(.*)(\})", r"\2"),
    (r"(frac)([^{])(.)", r"frac{\2}{\3}"),
    (r"(sqrt)([^{])", r"sqrt{\2}"),
)


def harness_normalize(final_answer: str) -> str:
    """lm-eval's normalize_final_answer, regexes and all: the reference for the linear version."""
    text = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        text = text.replace(expr, "")
    for pattern, replacement in HARNESS_TEX_REWRITES:
        text = re.sub(pattern, replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


PIECES = ["$", "\\text{", "\\textbf{", "\\overline{", "\\boxed{", "}", "{", "\n", "frac", "sqrt", "=", " ", "a",
          "1", ",", "x", "\\", "\\$", "mbox", "degrees"]


@pytest.mark.parametrize("seed", range(20))
def test_linear_normalization_equals_the_harness_regexes(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 24)))
        assert normalize_final_answer(text) == harness_normalize(text), repr(text)


ADVERSARIAL = {
    "no dollar pair": "1" * 16_000,
    "one dollar": "$" + "1" * 16_000,
    "unclosed text": "\\text{" * 2_700,
    "unclosed boxed": "\\boxed{" * 2_300,
    "unclosed overline": "\\overline{ " * 1_500,
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_long_ground_truth_verifies_fast(name: str) -> None:
    truth = ADVERSARIAL[name]
    assert normalize_final_answer(truth[:200]) == harness_normalize(truth[:200])
    normalize_ground_truth.cache_clear()
    start = time.perf_counter()
    dapo_verify("Answer: 1", truth)  # normalizes the ground truth (the harness regexes: ~1 s here)
    first = time.perf_counter() - start
    assert first < 0.1, f"{first:.3f} s for a {len(truth)}-character ground truth"  # 10x the 10 ms target
    dapo_verify("Answer: 2", truth)
    assert normalize_ground_truth.cache_info().hits == 1  # once per ground truth, not once per response


def test_megabyte_response_verifies_fast() -> None:
    response = ("\\boxed{" + "$" * 3 + "x" * 1000 + "\n") * 1000 + "Answer: 540"
    assert len(response) > 1_000_000
    start = time.perf_counter()
    assert dapo_verify(response, "540").acc
    assert time.perf_counter() - start < 0.1


def test_absurd_ground_truth_is_rejected_with_a_reason() -> None:
    with pytest.raises(ValueError, match=r"ground truth of 100,001 characters .* not an answer"):
        normalize_ground_truth("7" * 100_001)


@pytest.mark.parametrize("score", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_names_prompt_and_response(score: float) -> None:
    with pytest.raises(RewardError, match=r"for prompt data.jsonl:7 \(response ending 'Answer: 5'\)"):
        check_reward(score, "data.jsonl:7", "Answer: 5")
    check_reward(-1.0, "data.jsonl:7", "Answer: 5")


# ---------------------------------------------------------------------------------------------
# dapo_verl: current verl's \boxed{} fallback (verl 0.9 math_dapo.compute_score)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, correct, pred",
    [
        ("So \\boxed{540}", True, "540"),  # no Answer line: the last box decides
        ("\\boxed{7} first, then \\boxed{540}", True, "540"),  # the last box wins
        ("\\boxed{\\frac{1}{2}}", False, "\\frac{1}{2}"),  # nested braces balanced; raw content compared
        ("\\boxed{ 540 }", False, " 540 "),  # raw: no normalization on the fallback path
        ("\\boxed{$540$}", False, "$540$"),
        ("\\boxed{540", False, ""),  # never closed: nothing extracted
        ("The answer is 540", False, ""),  # neither an Answer line nor a box
        ("\\boxed{540}\nAnswer: 7", False, "7"),  # an Answer line wins over any box
        ("Answer: $540$\n\\boxed{7}", True, "540"),  # ... and is normalized as the release does
    ],
)
def test_dapo_verl_falls_back_to_the_last_box(response: str, correct: bool, pred: str) -> None:
    v = dapo_verl_verify(PREAMBLE + response, "540")
    assert (v.acc, v.score, v.pred) == (correct, 1.0 if correct else -1.0, pred)
    assert not dapo_verify(PREAMBLE + response, "540").acc or "Answer" in response  # the release: no fallback


def test_dapo_verl_box_is_searched_in_the_last_100_characters_only() -> None:
    inside, outside = "\\boxed{540}" + "x" * (100 - len("\\boxed{540}")), "\\boxed{540}" + "x" * 100
    assert dapo_verl_verify(inside, "540").acc and not dapo_verl_verify(outside, "540").acc
    assert last_boxed_content("a \\boxed{{b}c} d") == "{b}c" and last_boxed_content("none") is None


def test_dapo_verl_is_a_named_verifier() -> None:
    from flashdapo.config import AlgorithmConfig

    assert get_verifier("dapo_verl") is dapo_verl_verify
    assert AlgorithmConfig(verifier="dapo_verl").verifier == "dapo_verl" and AlgorithmConfig().verifier == "dapo"


# ---------------------------------------------------------------------------------------------
# The random reward (algorithm.verifier=random): the reward-free control


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_random_reward_frequency_is_p_within_binomial_noise(p: float) -> None:
    from flashdapo.reward import RandomReward

    reward = RandomReward(p=p, seed=3)
    n = 20000
    hits = sum(reward.verdict(1, step, 1, 0, group, member).acc
               for step in range(10) for group in range(125) for member in range(16))
    sd = math.sqrt(n * p * (1 - p))
    assert abs(hits - n * p) < 5 * sd, (hits, n * p, sd)  # 5 sd: a false alarm about once in 3.5 million


def test_random_reward_is_plus_one_or_minus_one_and_acc_follows_it() -> None:
    from flashdapo.reward import RandomReward

    verdicts = [RandomReward(0.5, 0).verdict(1, 1, 1, 0, g, 0) for g in range(200)]
    assert {v.score for v in verdicts} == {1.0, -1.0}
    assert all(v.acc == (v.score == 1.0) for v in verdicts)
    assert all(RandomReward(1.0, 0).verdict(1, 1, 1, 0, g, 0).acc for g in range(200))
    assert not any(RandomReward(0.0, 0).verdict(1, 1, 1, 0, g, 0).acc for g in range(200))


def test_random_reward_repeats_bitwise_and_depends_on_seed_and_key() -> None:
    from flashdapo.reward import RandomReward

    keys = [(1, step, 1, 0, group, member) for step in (1, 2) for group in range(20) for member in range(8)]
    first = [RandomReward(0.5, 7).verdict(*k) for k in keys]
    again = [RandomReward(0.5, 7).verdict(*k) for k in keys]
    assert first == again
    other_seed = [RandomReward(0.5, 8).verdict(*k) for k in keys]
    assert first != other_seed
    # Members of one group draw independently (not one draw per group).
    assert len({tuple(v.acc for v in first[i:i + 8]) for i in range(0, len(first), 8)}) > 1


def test_random_reward_in_score_groups_ignores_the_response_text() -> None:
    from flashdapo.config import toy
    from flashdapo.data import Prompt
    from flashdapo.reward import RandomReward
    from flashdapo.rollout import Rollouts
    from flashdapo.trainer.collect.rounds import score_groups

    class Decoder:
        def batch_decode(self, ids, skip_special_tokens=True):
            raise AssertionError("the random reward must not read the response")

    prompts = [Prompt(ids=[5, 6], ground_truth="3", source="t:0"), Prompt(ids=[7], ground_truth="4", source="t:1")]

    def rollouts(tokens):
        return Rollouts(prompt_ids=[torch.tensor(p.ids) for p in prompts for _ in range(4)],
                        response_ids=[torch.tensor(t) for t in tokens], group_ids=torch.tensor([0] * 4 + [1] * 4),
                        truncated=torch.zeros(8, dtype=torch.bool))

    cfg = dataclasses.replace(toy(), algorithm=dataclasses.replace(toy().algorithm, overlong_buffer=False))
    reward, keys = RandomReward(0.5, 11), [(1, 4, 1, 0, 0), (1, 4, 1, 0, 1)]
    a = score_groups(rollouts([[1]] * 8), prompts, Decoder(), reward, cfg, keys)
    b = score_groups(rollouts([[9, 9, 9], [2], [3, 3], [4], [8], [1, 2], [3], [0]]), prompts, Decoder(), reward, cfg,
                     keys)
    for ga, gb, key in zip(a, b, keys):
        assert torch.equal(ga.acc, gb.acc) and torch.equal(ga.scores, gb.scores)
        assert ga.acc.tolist() == [reward.verdict(*key, m).acc for m in range(4)]
    with pytest.raises(ValueError, match="one key per prompt"):
        score_groups(rollouts([[1]] * 8), prompts, Decoder(), reward, cfg)


def test_random_verifier_is_a_config_choice_judged_by_dapo_elsewhere() -> None:
    from flashdapo.config import AlgorithmConfig, ConfigError
    from flashdapo.reward import judging_verifier

    assert AlgorithmConfig(verifier="random").random_reward_p == 0.5
    assert judging_verifier("random") == "dapo" and judging_verifier("math_verify") == "math_verify"
    with pytest.raises(ConfigError, match=r"algorithm.random_reward_p: expected a value in \[0, 1\]"):
        AlgorithmConfig(verifier="random", random_reward_p=1.5)

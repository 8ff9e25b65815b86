"""Rule-based verifiers: the DAPO "Answer:" rule (default) and an optional math-verify backend.

The DAPO rule, exactly as released (verl `utils/reward_score/math_dapo.py`, `compute_score` with
`strict_box_verify=False`; see docs/algorithm.md, section 4):

1. Keep only the last 300 characters of the decoded response.
2. Take the LAST case-insensitive match of `Answer\\s*:\\s*([^\\n]+)` in that window (the rest of the
   line after the colon). No match -> invalid: score -1, acc False, pred "".
3. Normalize the extraction AND the ground truth with the Minerva / lm-eval `normalize_final_answer`
   (hendrycks_math / minerva_math harness): text after the last "="; fixed substitutions (articles,
   "\\$", "\\ ", spaces, "mbox" -> "text", "\\text{and}" -> ","); removal of unit words and TeX noise;
   keep the inside of the first $...$; unwrap \\text{}, \\textbf{}, \\overline{}, \\boxed{}; repair
   "\\fracab" -> "\\frac{a}{b}" and "\\sqrta" -> "\\sqrt{a}"; delete "$"; drop commas from pure digit
   strings; strip.
4. Correct iff the two normalized strings are exactly equal: score +1.0, else -1.0.

So "Answer: $540$", "answer:540", "Answer: x = 540" and "Answer: 540 degrees" match "540", while
"Answer: 540.", "Answer: **540**", "Answer: 540.0" and a bare "\\boxed{540}" do not. `Verdict.pred`
is the normalized extraction (what was compared against the normalized ground truth).

The substitution and removal lists are data from EleutherAI's lm-evaluation-harness (Apache-2.0),
reproduced entry for entry, quirks included ("sue", "\\text{<newline>s}"), because the rule is
defined by them.

`dapo_verl` is the same rule as current verl (0.9) applies it: when the window holds no "Answer:" line, the
last `\\boxed{...}` (braces balanced) within the window's last 100 characters is taken instead, and its raw
content must equal the raw ground truth (no normalization on that path: verl's strict-box comparison).

`math_verify` (optional extra `math`) instead parses both sides into sympy and checks equivalence.

`random` (`RandomReward`) is no verifier but the reward-free control of a training run: each response is
judged correct with probability p, drawn from a seed of the run seed and the response's place in the run
(step, generation round, rank, group, member), never from its text, so no output can earn a higher reward.
It is the training reward only; validation and `flashdapo eval` judge with the `dapo` rule.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .errors import FlashdapoError
from .seeds import derive_seed

__all__ = [
    "training_reward",
    "MAX_GROUND_TRUTH_CHARS",
    "RANDOM_VERIFIER",
    "REMOVED_EXPRESSIONS",
    "RandomReward",
    "RewardError",
    "SUBSTITUTIONS",
    "VERIFIERS",
    "Verdict",
    "Verifier",
    "dapo_verify",
    "dapo_verl_verify",
    "check_reward",
    "extract_answer",
    "get_verifier",
    "judging_verifier",
    "last_boxed_content",
    "math_verify_verify",
    "normalize_final_answer",
    "normalize_ground_truth",
    "verify_responses",
]


@dataclass(frozen=True)
class Verdict:
    """The verifier's judgement of one response."""

    score: float
    """Reward: +1.0 if correct, -1.0 otherwise (overlong shaping is added elsewhere)."""
    acc: bool
    """Correctness; dynamic sampling filters groups on this, not on the shaped score."""
    pred: str
    """The prediction as compared: the normalized extraction; "" when nothing was extracted."""


class Verifier(Protocol):
    """Anything that judges a decoded response against a ground-truth answer string."""

    def __call__(self, response: str, ground_truth: str) -> Verdict: ...


# ---------------------------------------------------------------------------------------------
# The DAPO rule
# ---------------------------------------------------------------------------------------------

WINDOW_CHARS = 300
"""Only this many trailing characters of a response are searched (verl: `solution_str[-300:]`)."""

ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
"""The answer line; the last match in the window wins."""

# (before, after) pairs applied in order with str.replace.
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Deleted in order with str.replace (substring match anywhere, not whole words).
REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",  # a real newline, as in the harness
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",  # a real newline, as in the harness
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)

# The harness's TeX rewrites in order: keep the inside of the first $...$; unwrap \text{}, \textbf{},
# \overline{} (up to the first "}"), \boxed{} (greedy: up to the last "}"); repair \frac and \sqrt. The
# harness writes the first five as regexes that backtrack quadratically on long lines (every start position
# scans to the end of its line); the linear scans below produce the same text (the tests compare them with the
# regexes on random and adversarial strings). `.` in those regexes never crosses a newline: neither do these.
_FRAC_SQRT = (
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),  # \sqrta -> \sqrt{a}
)

MAX_GROUND_TRUTH_CHARS = 100_000
"""Longer ground truths are rejected with a ValueError: they are not answers (the normalization is linear,
so this only bounds memory and a pathological dataset row)."""


def _keep_first_dollar_pair(text: str) -> str:
    """Each line holding two "$" becomes "$<text between its first two $>$" (the harness's first rewrite)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        first = line.find("$")
        second = line.find("$", first + 1) if first >= 0 else -1
        if second >= 0:
            lines[i] = "$" + line[first + 1:second] + "$"
    return "\n".join(lines)


def _unwrap_lazy(text: str, opener: str) -> str:
    """`opener...}` -> `...` up to the first "}" on the same line, left to right, never re-scanning."""
    out, pos = [], 0
    while True:
        start = text.find(opener, pos)
        if start < 0:
            break
        inner = start + len(opener)
        close = text.find("}", inner)
        newline = text.find("\n", inner)
        if close < 0 or 0 <= newline < close:  # no "}" on this line: no later opener of the line has one
            if newline < 0:
                break
            out.append(text[pos:newline])
            pos = newline
            continue
        out.append(text[pos:start] + text[inner:close])
        pos = close + 1
    out.append(text[pos:])
    return "".join(out)


def _unwrap_boxed(text: str) -> str:
    """Per line: the first `\\boxed{` before the line's last "}" loses its wrapper up to that last "}"."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        start = line.find("\\boxed{")
        last = line.rfind("}")
        if 0 <= start and start + len("\\boxed{") <= last:
            lines[i] = line[:start] + line[start + len("\\boxed{"):last] + line[last + 1:]
    return "\n".join(lines)


def normalize_final_answer(final_answer: str) -> str:
    """Normalize an answer string the Minerva / lm-eval way (see the module docstring); linear time.

    Applied to both the extracted prediction and the ground truth before exact comparison.
    """
    text = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        text = text.replace(expr, "")
    text = _keep_first_dollar_pair(text)
    for opener in ("\\text{", "\\textbf{", "\\overline{"):
        text = _unwrap_lazy(text, opener)
    text = _unwrap_boxed(text)
    for pattern, replacement in _FRAC_SQRT:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


@functools.lru_cache(maxsize=8192)
def normalize_ground_truth(ground_truth: str) -> str:
    """`normalize_final_answer` of a ground truth, computed once per distinct answer (every response of a
    prompt shares it); rejects absurd lengths."""
    if len(ground_truth) > MAX_GROUND_TRUTH_CHARS:
        raise ValueError(
            f"ground truth of {len(ground_truth):,} characters (starting {ground_truth[:40]!r}) "
            f"exceeds {MAX_GROUND_TRUTH_CHARS:,}: not an answer; check the dataset's answer column")
    return normalize_final_answer(ground_truth)


def extract_answer(response: str) -> str | None:
    """The raw text after the last "Answer:" in the response's last 300 characters, or None."""
    matches = ANSWER_PATTERN.findall(response[-WINDOW_CHARS:])
    return matches[-1] if matches else None


def dapo_verify(response: str, ground_truth: str) -> Verdict:
    """Judge `response` against `ground_truth` with the DAPO rule as released (+1 / -1)."""
    extracted = extract_answer(response)
    if extracted is None:
        return Verdict(score=-1.0, acc=False, pred="")
    pred = normalize_final_answer(extracted)
    correct = pred == normalize_ground_truth(ground_truth)
    return Verdict(score=1.0 if correct else -1.0, acc=correct, pred=pred)


# ---------------------------------------------------------------------------------------------
# The DAPO rule with current verl's \boxed{} fallback
# ---------------------------------------------------------------------------------------------

BOXED_WINDOW_CHARS = 100
"""The boxed fallback searches only this many trailing characters of the 300-character window (verl 0.9
`is_correct_strict_box`: `pred[-100:]`)."""


def last_boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, braces balanced; None when there is none or its
    braces never close."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if text[i] == "}" and depth == 0:
            return text[start + len("\\boxed{"):i]
    return None


def dapo_verl_verify(response: str, ground_truth: str) -> Verdict:
    """The DAPO rule as verl 0.9's `math_dapo.compute_score` applies it (+1 / -1): the "Answer:" rule first;
    when no Answer line is found, the last \\boxed{} of the last 100 characters of the window, compared raw
    (unnormalized) with the raw ground truth."""
    if extract_answer(response) is not None:
        return dapo_verify(response, ground_truth)
    boxed = last_boxed_content(response[-WINDOW_CHARS:][-BOXED_WINDOW_CHARS:])
    if boxed is None:
        return Verdict(score=-1.0, acc=False, pred="")
    correct = boxed == ground_truth
    return Verdict(score=1.0 if correct else -1.0, acc=correct, pred=boxed)


# ---------------------------------------------------------------------------------------------
# math-verify (optional extra)
# ---------------------------------------------------------------------------------------------

_MATH_HINT = "the 'math_verify' verifier needs the math-verify package: pip install 'flashdapo[math]'"


def _require_math_verify() -> None:
    try:
        found = importlib.util.find_spec("math_verify") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ImportError(_MATH_HINT)


def math_verify_verify(response: str, ground_truth: str) -> Verdict:
    """Judge by equivalence with the math-verify package (+1 / -1).

    The ground truth is parsed as `\\boxed{ground_truth}` (unless it already holds a \\boxed{});
    the whole response is parsed with math-verify's default extraction (boxed, LaTeX and plain
    expressions; the last answer found wins). `pred` is math-verify's string form of the parsed
    prediction, "" when nothing parsed. Parse or comparison errors count as wrong.
    """
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError(_MATH_HINT) from err
    # math-verify's timeouts use SIGALRM, which only the main thread may install.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_text = ground_truth if "\\boxed" in ground_truth else f"\\boxed{{{ground_truth}}}"
    try:
        gold = parse(gold_text, parsing_timeout=timeout)
        answer = parse(response, parsing_timeout=timeout)
        correct = bool(gold) and bool(answer) and bool(verify(gold, answer, timeout_seconds=timeout))
    except Exception:  # math-verify raises assorted sympy/ANTLR/timeout errors on odd input
        return Verdict(score=-1.0, acc=False, pred="")
    pred = str(answer[-1]) if answer else ""
    return Verdict(score=1.0 if correct else -1.0, acc=correct, pred=pred)


# ---------------------------------------------------------------------------------------------
# Registry and batch scoring
# ---------------------------------------------------------------------------------------------

VERIFIERS: dict[str, Callable[[str, str], Verdict]] = {
    "dapo": dapo_verify,
    "dapo_verl": dapo_verl_verify,
    "math_verify": math_verify_verify,
}
"""Verifier names accepted by `get_verifier` (and by the config's `verifier` field)."""


def get_verifier(name: str) -> Verifier:
    """Return the verifier called `name` ("dapo", "dapo_verl" or "math_verify").

    Raises ValueError for an unknown name, and ImportError (naming the pip extra) when
    "math_verify" is asked for without the math-verify package installed.
    """
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; expected one of {sorted(VERIFIERS)}")
    if name == "math_verify":
        _require_math_verify()
    return VERIFIERS[name]


RANDOM_VERIFIER = "random"
"""algorithm.verifier's reward-free control (`RandomReward`); not in VERIFIERS: it judges no text."""


def judging_verifier(name: str) -> str:
    """The verifier that judges validation and evaluation for algorithm.verifier `name`: itself, or the
    `dapo` rule when training's reward is random (accuracy on the task stays measurable)."""
    return "dapo" if name == RANDOM_VERIFIER else name


def training_reward(name: str, random_p: float, seed: int) -> Verifier | RandomReward:
    """What scores training's responses for algorithm.verifier `name`: the verifier itself, or the seeded
    `RandomReward` of the reward-free control (one rule for the co-located and the split rollout side)."""
    return RandomReward(random_p, seed) if name == RANDOM_VERIFIER else get_verifier(name)


@dataclass(frozen=True)
class RandomReward:
    """The reward-free control: correct (+1) with probability `p`, else wrong (-1), per response.

    The draw is a pure function of `seed` (the run seed) and the response's key (its place in the run, e.g.
    step, round, rank, group, member), independent of the response's text, the process and the machine:
    a uniform u in [0, 1) from the blake2b seed of the key (`derive_seed`), correct iff u < p."""

    p: float
    seed: int

    def verdict(self, *key: int) -> Verdict:
        """The verdict of the response named by `key` (integers)."""
        u = derive_seed(self.seed, *key) / 2.0**62
        hit = u < self.p
        return Verdict(score=1.0 if hit else -1.0, acc=hit, pred="")


class RewardError(FlashdapoError, ValueError):
    """A verifier returned a reward that is not a finite number."""

    every_rank = False  # each rank scores its own responses


def check_reward(score: float, prompt: str, response: str) -> None:
    """Raise RewardError naming the prompt and the response when `score` is NaN or infinite: one such
    reward turns every advantage of its group, and then the weights, into NaN."""
    if not math.isfinite(score):
        tail = response[-120:]
        raise RewardError(
            f"reward {score} for prompt {prompt} (response ending {tail!r}): a reward must be a "
            "finite number; check the verifier and algorithm.overlong_penalty_factor")


def verify_responses(response_ids: Sequence[Sequence[int]], ground_truths: Sequence[str], tokenizer,
                     verifier: Verifier) -> tuple[list[str], list[Verdict]]:
    """Decode each response's token ids (special tokens dropped) and judge it against its ground truth
    (same length, paired by position): the one decode-and-verify of training and evaluation. Returns the
    decoded texts and the verdicts."""
    if len(response_ids) != len(ground_truths):
        raise ValueError(
            f"verify_responses: {len(response_ids)} responses but {len(ground_truths)} ground truths"
        )
    ids = [r.tolist() if hasattr(r, "tolist") else list(r) for r in response_ids]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True) if ids else []
    return texts, [verifier(text, truth) for text, truth in zip(texts, ground_truths, strict=True)]

"""Evaluation results and their metrics: mean@k, unbiased pass@k, maj@k, per data source and pooled.

The choices, stated first:
- A prompt is evaluated with n samples (DAPO: n = 32 at temperature 1.0, top_p 0.7). `mean@k` is the
  mean accuracy over all n samples (avg@n, the paper's headline number; k = n in the key).
- `pass@j` for every j in 1..n is the unbiased estimator of Chen et al. (2021, "Evaluating Large
  Language Models Trained on Code", eq. 1): 1 - C(n-c, j) / C(n, j) for c correct of n, computed
  with exact integers. It is the probability that j samples drawn without replacement from the n
  contain a correct one, so it is neither the biased-low bootstrap nor the first-j estimate.
- `maj@j`: the n samples are cut into floor(n / j) consecutive blocks of j; each block votes on the
  extracted (normalized) answers and is right when its winner is correct; maj@j is the fraction of
  right blocks (unbiased for the majority vote of j i.i.d. samples). Empty extractions do not vote;
  a block with no vote is wrong. Ties go to the tied answer that appears first in the block, so the
  result depends only on the samples and their order, never on hashing or dict order.
- Metrics are reported per data source (`{prefix}/{source}/acc/...`) and pooled over all prompts
  (`{prefix}/acc/...`); pooled means are over prompts, not over sources. Logged keys carry the literal
  `@k` for j = n and `@j` for powers of two below n; `SourceMetrics` holds every j.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class SampleResult:
    """One sampled response, decoded and judged."""

    response: str
    pred: str
    """The verifier's normalized extraction; "" when no answer was found."""
    score: float
    acc: bool
    length: int
    """Response tokens (EOS included when sampled)."""
    finish_reason: str
    """"stop" (EOS sampled) or "length" (hit the token limit)."""


@dataclass
class PromptResult:
    """All n samples of one prompt, with where the prompt came from."""

    prompt_id: int
    """Index of the prompt in the (deduplicated) evaluation set."""
    source: str
    """'file:row' of the prompt's first occurrence."""
    data_source: str
    """The source it is reported under (the `data_source` column, or the file name)."""
    ground_truth: str
    samples: list[SampleResult]
    prompt: str = ""
    """The prompt text as the model saw it (decoded ids)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: dict) -> PromptResult:
        samples = [SampleResult(**s) for s in obj["samples"]]
        return cls(**{**obj, "samples": samples})


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for c correct samples out of n (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_answer(preds: list[str]) -> str | None:
    """The most frequent non-empty answer; ties go to the one seen first; None when nobody voted."""
    votes = Counter(p for p in preds if p)
    if not votes:
        return None
    top = max(votes.values())
    return next(p for p in preds if p and votes[p] == top)


def maj_at_k(samples: list[SampleResult], k: int) -> float:
    """Fraction of the floor(n / k) consecutive blocks of k samples whose majority answer is correct."""
    if not 1 <= k <= len(samples):
        raise ValueError(f"maj_at_k: need 1 <= k <= n={len(samples)}, got k={k}")
    blocks = [samples[i:i + k] for i in range(0, len(samples) - k + 1, k)]
    right = 0
    for block in blocks:
        winner = majority_answer([s.pred for s in block])
        right += winner is not None and any(s.acc for s in block if s.pred == winner)
    return right / len(blocks)


def reported_ks(n: int) -> list[int]:
    """The j of the logged pass@j / maj@j keys: powers of two below n (n itself is the `@k` key)."""
    return [2**i for i in range(n.bit_length()) if 2**i < n]


@dataclass
class SourceMetrics:
    """Metrics of one data source (or of all prompts pooled)."""

    source: str
    prompts: int
    n: int
    """Samples per prompt."""
    mean: float
    """mean@n: mean accuracy over every sample."""
    pass_at: dict[int, float] = field(default_factory=dict)
    """pass@j for j = 1..n (unbiased)."""
    maj_at: dict[int, float] = field(default_factory=dict)
    """maj@j for j = 1..n."""
    response_length: float = 0.0
    """Mean response tokens."""
    truncated: float = 0.0
    """Fraction of responses that hit the token limit."""

    def flat(self, prefix: str) -> dict[str, float]:
        """Logged keys: `{prefix}/acc/mean@k`, `pass@k`, `maj@k` (k = n), `pass@j` / `maj@j` for j in
        `reported_ks(n)`, and the response length / truncated fraction."""
        out = {f"{prefix}/acc/mean@k": self.mean, f"{prefix}/acc/pass@k": self.pass_at[self.n],
               f"{prefix}/acc/maj@k": self.maj_at[self.n]}
        for j in reported_ks(self.n):
            out[f"{prefix}/acc/pass@{j}"] = self.pass_at[j]
            out[f"{prefix}/acc/maj@{j}"] = self.maj_at[j]
        out[f"{prefix}/response_length/mean"] = self.response_length
        out[f"{prefix}/response_length/clip_ratio"] = self.truncated
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "pass_at": {str(j): v for j, v in self.pass_at.items()},
                "maj_at": {str(j): v for j, v in self.maj_at.items()}}


def source_metrics(source: str, results: list[PromptResult]) -> SourceMetrics:
    """mean@n, pass@j and maj@j (every j), length and truncation over `results` (all with the same n)."""
    if not results:
        raise ValueError(f"source_metrics: no prompts for source {source!r}")
    n = len(results[0].samples)
    uneven = next((r for r in results if len(r.samples) != n), None)
    if n == 0 or uneven is not None:
        raise ValueError(
            f"source_metrics: every prompt needs the same n >= 1 samples; prompt "
            f"{(uneven or results[0]).prompt_id} has {len((uneven or results[0]).samples)}, expected {n}")
    samples = [s for r in results for s in r.samples]
    correct = [sum(s.acc for s in r.samples) for r in results]
    return SourceMetrics(
        source=source, prompts=len(results), n=n,
        mean=sum(correct) / len(samples),
        pass_at={j: sum(pass_at_k(n, c, j) for c in correct) / len(results) for j in range(1, n + 1)},
        maj_at={j: sum(maj_at_k(r.samples, j) for r in results) / len(results) for j in range(1, n + 1)},
        response_length=sum(s.length for s in samples) / len(samples),
        truncated=sum(s.finish_reason == "length" for s in samples) / len(samples),
    )


POOLED = "all"
"""The name of the pooled row (every prompt of every source)."""


@dataclass
class EvalReport:
    """Per-source metrics (sorted by name) and the pooled ones."""

    sources: list[SourceMetrics]
    pooled: SourceMetrics

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        """Flat metrics: pooled `{prefix}/acc/...`, per source `{prefix}/{source}/acc/...`, and
        `{prefix}/k`."""
        out = {**self.pooled.flat(prefix), f"{prefix}/k": float(self.pooled.n)}
        for s in self.sources:
            out.update(s.flat(f"{prefix}/{metric_name(s.source)}"))
        return out

    def to_dict(self) -> dict:
        return {"pooled": self.pooled.to_dict(), "sources": [s.to_dict() for s in self.sources]}


def metric_name(source: str) -> str:
    """A data source as one metric-key component ('/' would add a level)."""
    return source.replace("/", "_") or "unknown"


def summarize(results: list[PromptResult]) -> EvalReport:
    """Group results by data source and compute every source's metrics and the pooled ones."""
    by_source: dict[str, list[PromptResult]] = {}
    for r in sorted(results, key=lambda r: r.prompt_id):
        by_source.setdefault(r.data_source, []).append(r)
    ordered = sorted(results, key=lambda r: r.prompt_id)
    return EvalReport(sources=[source_metrics(name, by_source[name]) for name in sorted(by_source)],
                      pooled=source_metrics(POOLED, ordered))


def format_report(report: EvalReport) -> str:
    """A Markdown table: one row per data source, then the pooled row."""
    n = report.pooled.n
    header = ["source", "prompts", f"mean@{n}", f"pass@{n}", f"maj@{n}", "mean length", "truncated"]
    rows = [[s.source, str(s.prompts), f"{s.mean:.4f}", f"{s.pass_at[n]:.4f}", f"{s.maj_at[n]:.4f}",
             f"{s.response_length:.1f}", f"{s.truncated:.4f}"] for s in [*report.sources, report.pooled]]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                           for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    rule = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])

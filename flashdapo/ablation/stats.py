"""The panels' statistics: paired per-seed differences, their mean, a Student t 95% confidence interval, a
two-sided paired t-test p-value, and Holm's correction across the panels' comparisons.

scipy is not a dependency, so the t distribution is computed here: its CDF through the regularized incomplete
beta function (continued fraction, modified Lentz), its quantile by bisection on that CDF.
tests/ablation/test_stats.py checks both against tabulated values and a textbook paired test.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import FlashdapoError


class StatsError(FlashdapoError, ValueError):
    """Bad input to a statistic (too few pairs, unpaired lists); the message says which."""


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz); converges fast for x < (a + 1) / (a + b + 2)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for numerator in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                          -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
        raise StatsError(f"regularized_beta: needs a, b > 0 and 0 <= x <= 1, got a={a}, b={b}, x={x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise StatsError(f"t_cdf: degrees of freedom must be > 0, got {df}")
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(q: float, df: float) -> float:
    """The t with P(T <= t) = q (0 < q < 1), by bisection on t_cdf to 1e-12."""
    if not 0.0 < q < 1.0:
        raise StatsError(f"t_quantile: q must be in (0, 1), got {q}")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < q:
        low, high = high, high * 2.0
    while high - low > 1e-12 * max(1.0, high):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if t_cdf(mid, df) < q else (low, mid)
    return 0.5 * (low + high)


@dataclass(frozen=True)
class PairedTest:
    """A paired comparison: treatment minus control, one difference per seed."""

    differences: tuple[float, ...]
    mean: float
    ci_low: float
    ci_high: float
    """The 95% (or `level`) Student t interval of the mean difference."""
    t: float
    p: float
    """Two-sided p-value of the paired t-test (H0: mean difference 0)."""

    @property
    def separated(self) -> bool:
        """The interval excludes 0."""
        return self.ci_low > 0.0 or self.ci_high < 0.0


def paired_test(treatment: Sequence[float], control: Sequence[float], level: float = 0.95) -> PairedTest:
    """Student's paired t-test of treatment[i] - control[i] (same seed i). Needs at least two pairs.
    Differences all equal: the interval is that value and p is 0 (a nonzero difference) or 1 (none)."""
    if len(treatment) != len(control):
        raise StatsError(
            f"paired_test: {len(treatment)} treatment values against {len(control)} control values; "
            "every seed needs both arms")
    if len(treatment) < 2:
        raise StatsError(f"paired_test: needs at least 2 paired seeds, got {len(treatment)}")
    diffs = tuple(float(t) - float(c) for t, c in zip(treatment, control, strict=True))
    n, mean = len(diffs), statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(n)
    if se == 0.0:
        return PairedTest(diffs, mean, mean, mean, math.copysign(math.inf, mean) if mean else 0.0,
                          0.0 if mean else 1.0)
    half = t_quantile(0.5 + level / 2.0, n - 1) * se
    t = mean / se
    p = min(1.0, 2.0 * (1.0 - t_cdf(abs(t), n - 1)))
    return PairedTest(diffs, mean, mean - half, mean + half, t, p)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: the i-th smallest (1-based) is multiplied by
    (m - i + 1), made non-decreasing, capped at 1."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [0.0] * len(p_values)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted

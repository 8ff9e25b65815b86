"""The panels' statistics against tabulated values and textbook examples."""

from __future__ import annotations

import math

import pytest

from flashdapo.ablation.stats import StatsError, holm, paired_test, regularized_beta, t_cdf, t_quantile


@pytest.mark.parametrize(("df", "q", "expected"), [
    (4, 0.975, 2.776445), (1, 0.975, 12.706205), (9, 0.975, 2.262157), (30, 0.975, 2.042272),
    (4, 0.95, 2.131847), (10, 0.995, 3.169273), (2, 0.9, 1.885618)])
def test_t_quantile_matches_the_tables(df, q, expected):
    assert t_quantile(q, df) == pytest.approx(expected, abs=2e-6)
    assert t_quantile(1 - q, df) == pytest.approx(-expected, abs=2e-6)


def test_t_cdf_closed_forms():
    # df = 1 is the Cauchy distribution, df = 2 has F(t) = 1/2 + t / (2 sqrt(t^2 + 2)).
    for t in (-3.0, -0.5, 0.0, 0.7, 4.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(t * t + 2)), abs=1e-12)


def test_regularized_beta_known_values():
    assert regularized_beta(1, 1, 0.3) == pytest.approx(0.3)  # uniform
    assert regularized_beta(2, 3, 0.4) == pytest.approx(0.5248)  # 1 - sum_{j<2} C(4,j) .4^j .6^(4-j)
    assert regularized_beta(5, 5, 0.5) == pytest.approx(0.5)  # symmetry
    with pytest.raises(StatsError, match="0 <= x <= 1"):
        regularized_beta(1, 1, 1.5)


def test_paired_t_on_the_sleep_data():
    # Student (1908) / Cushny and Peebles: extra hours of sleep under two drugs, the same 10 patients.
    # R: t.test(drug2, drug1, paired = TRUE): t = 4.0621, df = 9, p-value = 0.002833,
    # 95 percent confidence interval 0.7001142 2.4598858, mean difference 1.58.
    drug1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
    drug2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]
    test = paired_test(drug2, drug1)
    assert test.mean == pytest.approx(1.58)
    assert test.t == pytest.approx(4.0621, abs=1e-4)
    assert test.p == pytest.approx(0.002833, abs=1e-6)
    assert (test.ci_low, test.ci_high) == (pytest.approx(0.7001142, abs=1e-6), pytest.approx(2.4598858, abs=1e-6))
    assert test.separated
    reverse = paired_test(drug1, drug2)
    assert reverse.p == pytest.approx(test.p) and reverse.ci_high == pytest.approx(-test.ci_low)


def test_an_interval_that_holds_zero_is_not_separated():
    test = paired_test([1.0, 2.0, 3.0], [1.5, 1.0, 3.2])  # differences -0.5, 1.0, -0.2
    assert test.ci_low < 0 < test.ci_high and not test.separated and test.p > 0.05


def test_paired_test_refuses_unpaired_or_single_seeds():
    with pytest.raises(StatsError, match="every seed needs both arms"):
        paired_test([1.0, 2.0], [1.0])
    with pytest.raises(StatsError, match="at least 2"):
        paired_test([1.0], [0.0])


def test_equal_differences():
    assert paired_test([2.0, 3.0], [1.0, 2.0]).p == 0.0 and paired_test([1.0, 1.0], [1.0, 1.0]).p == 1.0


def test_holm_on_known_lists():
    # R: p.adjust(c(0.01, 0.02, 0.03, 0.04, 0.05), "holm") = 0.05 0.08 0.09 0.09 0.09
    assert holm([0.01, 0.02, 0.03, 0.04, 0.05]) == pytest.approx([0.05, 0.08, 0.09, 0.09, 0.09])
    # input order kept, capped at 1: R: p.adjust(c(0.04, 0.001, 0.6), "holm") = 0.08 0.003 0.6
    assert holm([0.04, 0.001, 0.6]) == pytest.approx([0.08, 0.003, 0.6])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and holm([]) == []

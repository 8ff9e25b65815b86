"""mean@k / pass@k / maj@k from hand-made verdicts."""

import pytest

from flashdapo.evaluate import EvalResult
from flashdapo.reward import Verdict

R, W = (lambda p: Verdict(1.0, True, p)), (lambda p: Verdict(-1.0, False, p))


def test_metrics_by_hand():
    verdicts = [
        [R("5"), W("4"), W("4")],  # majority "4" is wrong; pass
        [R("7"), R("7"), W("1")],  # majority right
        [W(""), W(""), W("3")],    # invalid answers do not vote; "3" wins and is wrong
        [W(""), W(""), W("")],     # nothing to vote for
    ]
    result = EvalResult(k=3, verdicts=verdicts, response_lengths=[4] * 12, truncated=3)
    assert result.mean_at_k == pytest.approx(3 / 12)
    assert result.pass_at_k == pytest.approx(2 / 4)
    assert result.maj_at_k == pytest.approx(1 / 4)
    m = result.metrics("val")
    assert m["val/acc/mean@k"] == pytest.approx(0.25) and m["val/response_length/clip_ratio"] == 0.25


def test_majority_tie_goes_to_the_first_answer_seen():
    result = EvalResult(k=2, verdicts=[[R("2"), W("3")], [W("3"), R("2")]], response_lengths=[1] * 4, truncated=0)
    assert result.maj_at_k == pytest.approx(0.5)

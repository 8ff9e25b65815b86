"""DAPO math against values computed by hand (float64), DAPO.md sections 1-3."""

import math

import pytest
import torch

from flashdapo.algorithm import global_token_count, group_advantages, informative_groups, overlong_penalty


@pytest.mark.parametrize(
    "length, expected",
    [(0, 0.0), (12, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (20, -1.0), (21, -1.0), (100, -1.0)],
)
def test_overlong_penalty_ramp(length, expected):
    # L_max = 20, L_cache = 4: free up to 16, linear over 17..20, -1 beyond.
    got = overlong_penalty(torch.tensor([length]), max_len=20, buffer_len=4, factor=1.0)
    assert got.item() == pytest.approx(expected)


def test_overlong_penalty_recipe_numbers_and_factor():
    lengths = torch.tensor([16384, 16385, 18432, 20480, 20481])
    got = overlong_penalty(lengths, max_len=20480, buffer_len=4096, factor=0.5)
    expected = torch.tensor([0.0, -1 / 4096, -0.5, -1.0, -1.0]) * 0.5
    torch.testing.assert_close(got, expected)


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=5)


def test_group_advantages_hand_computed():
    scores = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, -2.0, 0.5])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 11])  # arbitrary ids, interleaved sizes 4, 2, 1
    adv = group_advantages(scores, groups, eps=1e-6)
    # Group 7: mean -0.5, unbiased std sqrt((2.25 + 3 * 0.25) / 3) = 1.
    s7 = math.sqrt((1.5**2 + 3 * 0.5**2) / 3)
    # Group 3: mean -0.5, unbiased std sqrt((1.5^2 * 2) / 1).
    s3 = math.sqrt(2 * 1.5**2)
    expected = [1.5 / (s7 + 1e-6), -0.5 / (s7 + 1e-6), -0.5 / (s7 + 1e-6), -0.5 / (s7 + 1e-6),
                1.5 / (s3 + 1e-6), -1.5 / (s3 + 1e-6), 0.5 / (1 + 1e-6)]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float32))


def test_group_advantages_all_equal_group_is_zero():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    assert torch.equal(adv, torch.zeros(3))


def test_informative_groups_uses_acc_not_score():
    acc = torch.tensor([True, True, False, False, True, False, True])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    keep = informative_groups(acc, groups)
    assert keep.tolist() == [False, False, False, False, True, True, True]


def test_global_token_count_without_process_group():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert global_token_count(mask).item() == 3

"""The step's TrainBatch (built once, every per-response field filled) and the mini-batch layout."""

import math

import pytest
import torch

from flashdapo.algorithm import group_advantages
from flashdapo.config import AlgorithmConfig
from flashdapo.trainer.batch import Group, TrainBatch, build_train_batch, mini_batch_layout


@pytest.mark.parametrize("num_groups, mini_batch, world", [(8, 2, 1), (8, 2, 2), (12, 4, 4), (6, 4, 2), (4, 4, 4),
                                                             (10, 4, 2), (0, 2, 2), (2, 4, 2)])
def test_layout_gives_each_rank_its_part_of_every_global_mini_batch(num_groups, mini_batch, world):
    layouts = [mini_batch_layout(num_groups, mini_batch, world, rank) for rank in range(world)]
    assert len({len(layout) for layout in layouts}) == 1, "every rank takes the same number of optimizer steps"
    offset = 0
    for k in range(len(layouts[0])):
        # Global mini-batch k, read over the ranks in order, is the next contiguous run of groups, and
        # every rank holds an equal part of it.
        merged = [i for layout in layouts for i in layout[k]]
        assert merged == list(range(offset, offset + len(merged)))
        assert len({len(layout[k]) for layout in layouts}) == 1
        offset += len(merged)
    one_rank = mini_batch_layout(num_groups, mini_batch, 1, 0)
    everything = sorted(i for layout in layouts for part in layout for i in part)
    assert everything == list(range(num_groups))
    # A short batch keeps the mini-batch size and takes fewer optimizer steps: all full but the last.
    assert len(one_rank) == max(1, -(-num_groups // mini_batch))
    assert all(len(part) == mini_batch for part in one_rank[:-1])


def _group(sizes_seed: int, n: int = 3, truncated_first: bool = False) -> Group:
    g = torch.Generator().manual_seed(sizes_seed)
    responses = [torch.randint(0, 9, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g) for _ in range(n)]
    truncated = torch.zeros(n, dtype=torch.bool)
    truncated[0] = truncated_first
    return Group(torch.tensor([1, 2]), responses, torch.randn(n, generator=g), torch.rand(n, generator=g) > 0.5,
                 truncated)


@pytest.mark.parametrize("overlong_filter", [False, True])
def test_build_fills_every_per_response_field_once(overlong_filter):
    mini = [[_group(0), _group(1, truncated_first=True)], [_group(2)]]
    groups = [g for part in mini for g in part]
    old = [torch.randn(len(r)) for g in groups for r in g.responses]
    batch = build_train_batch(mini, old, AlgorithmConfig(overlong_filter=overlong_filter, advantage_eps=1e-3))
    assert batch.mini_batches == (slice(0, 2), slice(2, 3))
    ids = torch.tensor([0] * 3 + [1] * 3 + [2] * 3)
    torch.testing.assert_close(batch.advantages, group_advantages(batch.scores, ids, eps=1e-3))
    assert batch.loss_mask.tolist() == [True] * 3 + [not overlong_filter, True, True] + [True] * 3
    assert all(a is b for a, b in zip(batch.old_logprobs, old))
    assert all(torch.equal(w, torch.ones(len(o))) for w, o in zip(batch.rollout_weights, old))  # no correction
    with pytest.raises(AttributeError):
        batch.advantages = torch.zeros(9)  # frozen: no stage rewrites another stage's field


def test_batch_rejects_fields_that_do_not_match_the_responses():
    group = _group(0)
    old = tuple(torch.zeros(len(r)) for r in group.responses)
    ok = dict(groups=(group,), mini_batches=(slice(0, 1),), old_logprobs=old, advantages=torch.zeros(3),
              loss_mask=torch.ones(3, dtype=torch.bool), rollout_weights=tuple(torch.ones_like(t) for t in old))
    TrainBatch(**ok)
    with pytest.raises(ValueError, match="rollout_weights"):
        TrainBatch(**{**ok, "rollout_weights": ok["rollout_weights"][:2]})
    with pytest.raises(ValueError, match="old_logprobs"):
        TrainBatch(**{**ok, "old_logprobs": old[:2]})
    with pytest.raises(ValueError, match="old_logprobs"):
        TrainBatch(**{**ok, "old_logprobs": (torch.zeros(99),) + old[1:]})
    with pytest.raises(ValueError, match=r"advantages must be \[3\]"):
        TrainBatch(**{**ok, "advantages": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"loss_mask must be \[3\]"):
        TrainBatch(**{**ok, "loss_mask": torch.ones(4, dtype=torch.bool)})


def test_build_weighs_tokens_by_the_rollout_correction():
    mini = [[_group(0), _group(1)]]
    groups = mini[0]
    old = [torch.randn(len(r), generator=torch.Generator().manual_seed(i)) for i, r in
           enumerate(r for g in groups for r in g.responses)]
    with pytest.raises(ValueError, match="token_truncate needs the rollout engine's per-token log-probs"):
        build_train_batch(mini, old, AlgorithmConfig(), "token_truncate")
    flat = iter(old)
    for g in groups:  # the engine's log-probs: pi_old / pi_rollout = 3 on every token
        g.sampler_logprobs = [next(flat) - math.log(3.0) for _ in g.responses]
    batch = build_train_batch(mini, old, AlgorithmConfig(rollout_correction_cap=2.0), "token_truncate")
    assert all(torch.allclose(w, torch.full_like(w, 2.0)) for w in batch.rollout_weights)
    batch = build_train_batch(mini, old, AlgorithmConfig(rollout_correction_cap=4.0), "sequence_mask")
    assert all(torch.equal(w, torch.ones_like(w)) for w in batch.rollout_weights)

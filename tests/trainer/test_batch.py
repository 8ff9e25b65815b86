"""The step's TrainBatch (built once, every per-response field filled) and the dealing of mini-batches to slots."""

import math

import pytest
import torch

from flashdapo.algorithm import group_advantages
from flashdapo.config import AlgorithmConfig
from flashdapo.trainer.batch import Group, TrainBatch, build_train_batch
from flashdapo.trainer.collect.dealing import balance, deal_to_slots, slot_loads


def _lengths_group(index: int, prompt_len: int, response_lens: list[int], seed: int = 0) -> Group:
    g = torch.Generator().manual_seed(seed + index)
    n = len(response_lens)
    return Group(torch.ones(prompt_len, dtype=torch.long), [torch.ones(m, dtype=torch.long) for m in response_lens],
                 torch.randn(n, generator=g), torch.rand(n, generator=g) > 0.5, torch.zeros(n, dtype=torch.bool),
                 origin=(1 + index // 6, (index // 2) % 3, index))  # canonical order: sorted


@pytest.mark.parametrize("num_groups, mini_batch, slots", [(8, 2, 1), (8, 2, 2), (12, 4, 4), (6, 4, 2), (4, 4, 4),
                                                           (10, 4, 2), (0, 2, 2), (2, 4, 2), (16, 16, 8)])
def test_dealing_gives_every_response_of_each_global_mini_batch_to_one_slot(num_groups, mini_batch, slots):
    g = torch.Generator().manual_seed(num_groups * 31 + slots)
    ordered = [_lengths_group(i, int(torch.randint(2, 9, (1,), generator=g)),
                              torch.randint(1, 40, (4,), generator=g).tolist()) for i in range(num_groups)]
    dealt = [deal_to_slots(ordered, mini_batch, slots, s, advantage_eps=1e-3) for s in range(slots)]
    assert len({len(d) for d in dealt}) == 1, "every slot takes the same number of optimizer steps"
    # A short batch keeps the mini-batch size and takes fewer optimizer steps.
    assert len(dealt[0]) == max(1, -(-num_groups // mini_batch))
    for k in range(len(dealt[0])):
        expected = ordered[k * mini_batch:(k + 1) * mini_batch]  # global mini-batch k, as one rank holds it
        keys = sorted((p.origin, m) for d in dealt for p in d[k] for m in p.member_indices)
        assert keys == [(w.origin, m) for w in expected for m in range(w.size)]
        for piece in (p for d in dealt for p in d[k]):
            whole = next(w for w in expected if w.origin == piece.origin)
            idx = list(piece.member_indices)
            assert [r.tolist() for r in piece.responses] == [whole.responses[i].tolist() for i in idx]
            assert torch.equal(piece.scores, whole.scores[idx]) and torch.equal(piece.acc, whole.acc[idx])
            # The advantages are the whole group's, not the piece's own.
            full = group_advantages(whole.scores, torch.zeros(whole.size, dtype=torch.long), eps=1e-3)
            torch.testing.assert_close(piece.advantages, full[idx])
    if slots == 1:  # one slot: whole groups in canonical order, as the trainer always held them
        assert [p.origin for part in dealt[0] for p in part] == [w.origin for w in ordered]
        assert all(p.member_indices == tuple(range(p.size)) for part in dealt[0] for p in part)


def test_dealing_balances_slot_tokens_where_whole_groups_cannot():
    """The released 32B layout: 16 slots, 2 groups of 16 responses each per slot and mini-batch, DAPO-like
    lengths (a long tail up to 20k tokens)."""
    g = torch.Generator().manual_seed(0)
    slots, n = 16, 16
    costs = [(torch.distributions.LogNormal(7.5, 0.9).sample((n,)).clamp(max=20480) + 200).long().tolist()
             for _ in range(2 * slots)]
    del g
    owners = balance(costs, slots)
    loads = slot_loads(costs, owners, slots)
    per_group = [sum(c) for c in costs]
    contiguous = [per_group[2 * s] + per_group[2 * s + 1] for s in range(slots)]
    total = sum(per_group)
    assert sum(loads) == total and all(len(o) == n for o in owners)
    # Longest-processing-time bound: no slot exceeds the mean by more than the longest response.
    assert max(loads) <= total / slots + max(max(c) for c in costs)
    assert (total / slots) / max(loads) > 0.9 > (total / slots) / max(contiguous)


def test_a_piece_without_the_groups_advantages_is_refused():
    piece = Group(torch.tensor([1]), [torch.tensor([2])], torch.zeros(1), torch.zeros(1, dtype=torch.bool),
                  torch.zeros(1, dtype=torch.bool), members=(3,))
    with pytest.raises(ValueError, match="needs the whole group's advantages"):
        build_train_batch([[piece]], None, AlgorithmConfig())


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

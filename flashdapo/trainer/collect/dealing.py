"""Which responses of the step's kept groups each data-parallel slot trains on, balanced by tokens.

Every slot waits for the slowest at each FSDP2 collective, so a mini-batch's time is that of its slot with
the most tokens. The step's kept groups, in their canonical order (round, rank, position), form global
mini-batch k from the contiguous run of groups [k * mini_batch, (k + 1) * mini_batch), exactly as one rank
would; within it the responses (not whole groups) are dealt to the slots by longest-processing-time: the
longest response first, each to the slot with the fewest tokens so far. At DAPO's length spread whole
groups cannot balance two groups per slot (the recipe's 32B layout): a group's 16 responses are one heavy
item; responses can (docs/architecture.md, "Balanced slots").

Advantages are computed here over each whole group, before its responses scatter, and travel with them.
Nothing else reads where a response went: the token-level normalizer counts the whole mini-batch, and the
order-dependent ones (`token-mean-per-micro-batch`) sort the mini-batch back into the canonical order by
each response's key (`TrainBatch.response_keys`), so every loss mode's gradient is the one rank's.
A token's cost is its position in a packed row (prompt + response tokens): the attention's quadratic part
is not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...config import Config
from ...distributed.collectives import all_gather_objects
from ...distributed.mesh import DistEnv
from ..batch import Group, whole_group_advantages


def deal_kept(kept_per_round: list[list[Group]], cfg: Config, env: DistEnv, with_leftover: bool = False):
    """Order kept groups by origin (round or tick, rank, position), keep the first train_batch (or, when
    short, the largest multiple of the data-parallel size), and deal this data-parallel slot its responses of
    every global mini-batch (the ranks of a sequence-parallel group share a slot: the same responses).
    `with_leftover`: also this rank's own kept groups that did not make the cut, in order."""
    everyone = all_gather_objects(kept_per_round) if env.world_size > 1 else [kept_per_round]
    ordered = sorted((g for rank_rounds in everyone for rnd in rank_rounds for g in rnd),
                     key=lambda g: g.origin)
    usable = min(len(ordered), cfg.trainer.train_batch) // env.dp_size * env.dp_size
    dealt = deal_to_slots(ordered[:usable], cfg.trainer.mini_batch, env.dp_size, env.dp_rank,
                          cfg.algorithm.advantage_eps)
    if not with_leftover:
        return dealt
    cut = {g.origin for g in ordered[:usable]}
    return dealt, [g for rnd in kept_per_round for g in rnd if g.origin not in cut]


def deal_to_slots(ordered: Sequence[Group], mini_batch: int, slots: int, slot: int,
                  advantage_eps: float) -> list[list[Group]]:
    """Slot `slot`'s pieces of the groups of each global mini-batch (of `mini_batch` groups; the last holds
    the rest when the step came back short). `ordered`: the step's kept groups in canonical order, as many as
    train (a multiple of `slots`), the same list on every rank. No groups: one empty mini-batch."""
    layout = []
    for start in range(0, len(ordered), mini_batch):
        part = ordered[start:start + mini_batch]
        costs = [[len(g.prompt) + len(r) for r in g.responses] for g in part]
        owners = balance(costs, slots)
        mine = []
        for group, owner in zip(part, owners):
            members = [i for i, o in enumerate(owner) if o == slot]
            if members:
                mine.append(group.piece(members, whole_group_advantages(group, advantage_eps)))
        layout.append(mine)
    return layout or [[]]


def balance(costs: Sequence[Sequence[int]], slots: int) -> list[list[int]]:
    """The slot of every response (costs[g][i]: tokens of response i of group g), longest-processing-time
    first: responses by decreasing cost (ties in canonical order), each to the least-loaded slot (ties: the
    lowest). Deterministic, so every rank computes the same dealing."""
    owners = [[0] * len(c) for c in costs]
    loads = torch.zeros(slots, dtype=torch.long)
    items = sorted(((c, g, i) for g, group in enumerate(costs) for i, c in enumerate(group)),
                   key=lambda item: (-item[0], item[1], item[2]))
    for cost, g, i in items:
        target = int(torch.argmin(loads))  # the first of the least-loaded slots
        owners[g][i] = target
        loads[target] += cost
    return owners


def slot_loads(costs: Sequence[Sequence[int]], owners: Sequence[Sequence[int]], slots: int) -> list[int]:
    """Tokens per slot under a dealing (for reports and tests)."""
    loads = [0] * slots
    for group_costs, group_owners in zip(costs, owners):
        for c, o in zip(group_costs, group_owners):
            loads[o] += c
    return loads


__all__ = ["balance", "deal_kept", "deal_to_slots", "slot_loads"]

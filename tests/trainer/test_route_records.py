"""Routing replay's records travel with their responses (trainer/batch.py): through the Group plain codec (what
streaming's state, split placement's wire and its checkpoint parts hold) written with torch.save and read back
with weights_only, through dealing's pieces (each response keeps its own record), and into the TrainBatch and
the micro-batches' order; a group without records (R3 off) carries None and writes nothing new. Wall budget: 5 s."""

import io

import torch

from flashdapo.trainer.batch import Group, build_train_batch, flat_routes
from flashdapo.trainer.collect.dealing import deal_to_slots


def routed_group(origin: int, lengths=(3, 5, 2), prompt_len: int = 4, routes: bool = True) -> Group:
    """A scored group of len(lengths) responses whose records are [prompt + response - 1, 2 layers, top-2]
    uint8, each value naming (group, response)."""
    g = torch.Generator().manual_seed(origin)
    responses = [torch.randint(3, 50, (n,), generator=g) for n in lengths]
    records = [torch.full((prompt_len + n - 1, 2, 2), 10 * origin + i, dtype=torch.uint8)
               for i, n in enumerate(lengths)]
    n = len(lengths)
    return Group(torch.randint(3, 50, (prompt_len,), generator=g), responses, torch.linspace(-1, 1, n),
                 torch.arange(n) % 2 == 0, torch.zeros(n, dtype=torch.bool),
                 sampler_logprobs=[-torch.rand(k, generator=g) for k in lengths], origin=(0, 0, origin),
                 routes=records if routes else None)


def _through_bytes(plain):
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def test_records_survive_the_plain_codec():
    group = routed_group(1)
    back = Group.from_plain(_through_bytes(group.to_plain()))
    assert len(back.routes) == 3
    for a, b in zip(group.routes, back.routes):
        assert a.dtype == b.dtype == torch.uint8 and torch.equal(a, b)
    off = Group.from_plain(_through_bytes(routed_group(2, routes=False).to_plain()))
    assert off.routes is None
    older = routed_group(3).to_plain()
    del older["routes"]  # what a checkpoint written before routing replay holds
    assert Group.from_plain(older).routes is None


def test_dealt_pieces_keep_each_responses_record_and_the_batch_lists_them_in_order():
    groups = [routed_group(i, lengths=(2 + i, 4, 1, 3)) for i in range(2)]
    slots = [deal_to_slots(groups, 2, 2, rank, 1e-6) for rank in range(2)]
    for mine in slots:
        for part in mine:
            for piece in part:
                for m, record in zip(piece.member_indices, piece.routes):
                    source = groups[piece.origin[2]]
                    assert torch.equal(record, source.routes[m])
                    assert len(record) == len(source.prompt) + len(source.responses[m]) - 1
        batch = build_train_batch(mine, None, _algorithm())
        assert [int(r[0, 0, 0]) for r in batch.routes] == [10 * g.origin[2] + m for g in batch.groups
                                                            for m in g.member_indices]
    assert flat_routes([routed_group(5, routes=False)]) is None
    mixed = flat_routes([routed_group(5, routes=False, lengths=(2,)), routed_group(6, lengths=(2,))])
    assert mixed[0] is None and int(mixed[1][0, 0, 0]) == 60


def _algorithm():
    from flashdapo.config import toy

    return toy().algorithm

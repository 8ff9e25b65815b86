"""Routing replay's records on split placement's wire (trainer/split/wire.py): a batch's groups keep every
response's record through `pack` / `unpack` (bytes read with weights_only), in its dtype. Wall budget: 5 s."""

import torch

from flashdapo.trainer.batch import Group
from flashdapo.trainer.collect.rounds import Collected
from flashdapo.trainer.split.wire import BatchMessage, pack, unpack


def test_records_cross_the_wire():
    routes = [torch.randint(0, 300, (5, 2, 2)).to(torch.int16), torch.randint(0, 300, (4, 2, 2)).to(torch.int16)]
    group = Group(torch.tensor([3, 4, 5]), [torch.tensor([6, 7, 8]), torch.tensor([9, 1])], torch.tensor([1.0, -1.0]),
                  torch.tensor([True, False]), torch.tensor([False, False]), origin=(1, 0, 2), routes=routes)
    collected = Collected(mini_batches=[], num_gen_batches=1, groups_generated=1, groups_informative=1, gen_acc=0.5,
                          gen_score=0.0, gen_truncated=0.0)
    back = unpack(pack(BatchMessage(batch=3, weights_step=1, groups=[group], collected=collected)))
    assert [r.dtype for r in back.groups[0].routes] == [torch.int16, torch.int16]
    assert all(torch.equal(a, b) for a, b in zip(routes, back.groups[0].routes))
    plain = unpack(pack(BatchMessage(batch=4, weights_step=1, groups=[Group(**{**vars(group), "routes": None})],
                                     collected=collected)))
    assert plain.groups[0].routes is None

"""Routing replay's records in streaming's state (trainer/collect/streaming.py `StreamState`): a carried
response's record (the experts of every position fed so far) and a ready group's records come back from a
checkpoint (torch.save, then torch.load with weights_only), and a state written before routing replay (no
`routes` in its responses) still reads, as None. Wall budget: 5 s."""

import torch

from flashdapo.data import Prompt
from flashdapo.trainer.batch import Group
from flashdapo.trainer.collect.streaming import PendingGroup, Response, StreamState


def _state() -> StreamState:
    carried = Response(torch.tensor([7, 8, 9]), -torch.rand(3), torch.tensor([4, 4, 5]),
                       routes=torch.randint(0, 4, (3 + 3 - 1, 2, 2), dtype=torch.uint8))
    fresh = Response(torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    pending = PendingGroup(Prompt([3, 4, 5], "1", "toy:0"), [carried, fresh], (2, 0, 1))
    ready = Group(torch.tensor([3, 4]), [torch.tensor([5, 6])], torch.tensor([1.0]), torch.tensor([True]),
                  torch.tensor([False]), origin=(1, 0, 0), routes=[torch.full((3, 2, 2), 3, dtype=torch.uint8)])
    return StreamState(pending={6: pending}, ready=[ready], next_key=7, pulls=3)


def test_carried_and_ready_records_survive_a_checkpoint(tmp_path):
    state = _state()
    torch.save(state.to_plain(), tmp_path / "stream.pt")
    back = StreamState.from_plain(torch.load(tmp_path / "stream.pt", weights_only=True))
    carried, fresh = back.pending[6].responses
    assert torch.equal(carried.routes, state.pending[6].responses[0].routes) and carried.routes.dtype == torch.uint8
    assert fresh.routes is None
    assert torch.equal(back.ready[0].routes[0], state.ready[0].routes[0])


def test_a_state_from_before_routing_replay_reads_with_no_records(tmp_path):
    plain = _state().to_plain()
    for group in plain["pending"].values():
        for response in group["responses"]:
            del response["routes"]
    del plain["ready"][0]["routes"]
    torch.save(plain, tmp_path / "old.pt")
    back = StreamState.from_plain(torch.load(tmp_path / "old.pt", weights_only=True))
    assert back.pending[6].responses[0].routes is None and back.ready[0].routes is None

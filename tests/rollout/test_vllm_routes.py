"""Routing replay's records from vLLM without vLLM (rollout/vllm_outputs.py): `RouteCapture` hooks the routers
(`...mlp.gate`) of a model, keeps their logits only while capturing, and splits the positions of the sequences
prefilled in order into per-sequence top-k records (a count that does not add up is refused); `to_rollouts`
takes vLLM's own `CompletionOutput.routed_experts` where a build returns them. Wall budget: 3 s."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from flashdapo.rollout.vllm_outputs import RouteCapture, to_rollouts


class _Gate(nn.Module):
    def forward(self, hidden):
        return hidden[:, :4], None  # vLLM's GateLinear returns (router logits, bias)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module() for _ in range(2)])
        for layer in self.layers:
            layer.mlp = nn.Module()
            layer.mlp.gate = _Gate()

    def forward(self, hidden):
        for layer in self.layers:
            layer.mlp.gate(hidden)
            hidden = hidden.flip(-1)


def test_capture_splits_prefilled_positions_into_records():
    model, capture = _Model(), RouteCapture(top_k=2, num_experts=4)
    assert capture.install(model) == 2
    model(torch.randn(3, 4))  # not capturing: nothing kept
    capture.start()
    first, second = torch.randn(5, 4), torch.randn(2, 4)  # two forwards (the scheduler's steps), 3 + 2 + 2
    model(first)
    model(second)
    records = capture.routes([3, 2, 2])
    assert [tuple(r.shape) for r in records] == [(3, 2, 2), (2, 2, 2), (2, 2, 2)] and records[0].dtype == torch.uint8
    both = torch.cat([first, second])
    assert torch.equal(torch.cat(records)[:, 0].long(), both.topk(2, dim=-1).indices)
    assert torch.equal(torch.cat(records)[:, 1].long(), both.flip(-1).topk(2, dim=-1).indices)
    capture.start()
    model(torch.randn(4, 4))
    with pytest.raises(RuntimeError, match="saw \\[4\\] positions for 2 sequences of 5 positions"):
        capture.routes([3, 2])


def test_to_rollouts_takes_vllms_own_records():
    def completion(index, tokens, routed):
        return SimpleNamespace(index=index, token_ids=tokens, finish_reason="stop", routed_experts=routed,
                               logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in tokens])

    routed = np.arange(2 * 4 * 2 * 2).reshape(2, 4, 2, 2) % 4
    request = SimpleNamespace(outputs=[completion(1, [7, 8, 9], routed[1]), completion(0, [5, 6, 9], routed[0])])
    out = to_rollouts([request], [[3, 4]], n=2)
    assert [r.tolist() for r in out.routes] == [routed[0].tolist(), routed[1].tolist()]
    request.outputs[0].routed_experts = None
    assert to_rollouts([request], [[3, 4]], n=2).routes is None  # none unless every response has one

"""GPT-OSS as a mixture-of-experts family (models/hf.py: its `mlp.router` of every block): the router loss of a
tiny GPT-OSS (float64, sinks and a sliding layer) in flashdapo's policy == transformers' own aux_loss of each
sequence alone, gradient into the routers' weights and biases included, and the expert load == its top-k picks;
routing replay recomputes GPT-OSS's gate weights (softmax over the k picked logits) exactly. Wall budget: 15 s."""

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

from flashdapo.models.moe import (
    RouterLogits,
    is_moe,
    load_balancing,
    loss_routers,
    router_aux_coef,
    routers,
    token_sequences,
)
from flashdapo.models.moe.replay import replay_weights
from flashdapo.models.packing import use_packed_attention
from flashdapo.models.policy import PolicyModel, make_token_batch
from tests.helpers.moe import one_thread, tiny_gpt_oss

EXPERTS, TOP_K, VOCAB = 4, 2, 50
PROMPTS, RESPONSES = (5, 3, 9), (4, 7, 1)
"""Odd lengths, two past the sliding window; the last sequence's input is its prompt alone."""


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _sequences():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in PROMPTS]
    responses = [torch.randint(3, VOCAB, (n,), generator=g) for n in RESPONSES]
    return prompts, responses


def test_the_registry_names_gpt_oss_routers_and_its_coefficient():
    model = tiny_gpt_oss(output_router_logits=True)
    assert routers(model) == loss_routers(model) == [layer.mlp.router for layer in model.model.layers]
    assert is_moe(model.config) and router_aux_coef(None, model.config) == 0.01
    assert router_aux_coef(None, tiny_gpt_oss().config) == 0.0  # the switch off: transformers adds no loss


def test_router_loss_per_sequence_equals_transformers_and_its_gradient_reaches_the_routers():
    model = tiny_gpt_oss()
    prompts, responses = _sequences()
    reference, load = 0.0, torch.zeros(2, EXPERTS, dtype=torch.float64)
    for p, r in zip(prompts, responses):
        out = model(input_ids=torch.cat([p, r[:-1]])[None], output_router_logits=True)
        assert torch.equal(out.aux_loss, load_balancing_loss_func(out.router_logits, EXPERTS, TOP_K))
        reference = reference + out.aux_loss
        for layer, logits in enumerate(out.router_logits):
            load[layer] += torch.bincount(torch.topk(logits, TOP_K).indices.reshape(-1), minlength=EXPERTS).double()
    reference.backward()
    expected = [(router.weight.grad.clone(), router.bias.grad.clone()) for router in routers(model)]
    assert abs(float(reference.detach()) - TOP_K * len(prompts)) > 0.1  # not uniform routing
    for packed in (True, False):
        model.zero_grad()
        policy = PolicyModel(model, "eager", "torch", 1.0)
        policy.pack = packed
        if packed:
            use_packed_attention(model)
        batch = make_token_batch(prompts, responses, torch.device("cpu"), packed)
        routing = RouterLogits()
        policy(batch, routing=routing)
        assert len(routing.layers) == 2
        ids = token_sequences(len(prompts), batch.bounds, batch.attention_mask)
        balance = load_balancing(routing.layers, ids, len(prompts), top_k=TOP_K)
        # transformers sums its probabilities in float32: agreement to float32 rounding.
        torch.testing.assert_close(balance.loss_sum, reference.detach().double(), rtol=1e-6, atol=0)
        torch.testing.assert_close(balance.load, load, rtol=0, atol=0)
        balance.loss_sum.backward()
        for router, (weight, bias) in zip(routers(model), expected):
            assert weight.abs().max() > 1e-3 and bias.abs().max() > 1e-3
            torch.testing.assert_close(router.weight.grad, weight, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(router.bias.grad, bias, rtol=1e-5, atol=1e-9)


def test_replayed_gate_weights_are_gpt_oss_own():
    """Routing replay recomputes the gate weights as a softmax over all logits renormalised over the k picked
    (models/moe/replay.py); GPT-OSS's router takes the softmax of the k picked logits: the same numbers."""
    router = tiny_gpt_oss().model.layers[0].mlp.router
    hidden = torch.randn(7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    logits, scores, indices = router(hidden)
    replayed = replay_weights(logits, indices, norm_topk_prob=True)
    assert replayed.dtype == scores.dtype and (scores - 1 / TOP_K).abs().max() > 0.1  # far from even weights
    # the replay's softmax runs in float32 (as Qwen3-MoE's router does): agreement to float32 rounding
    torch.testing.assert_close(replayed, scores, rtol=2e-6, atol=1e-7)

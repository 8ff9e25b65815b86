"""The routers' load-balancing loss of a tiny Qwen3-MoE (float64) in flashdapo's policy, packed and padded:
per sequence == transformers' load_balancing_loss_func on that sequence's router logits (its own aux_loss),
gradient included; the expert load == the top-k picks; the registry names the routers."""

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from flashdapo.models.hf import config_keys
from flashdapo.models.moe import RouterLogits, load_balancing, routers, token_sequences
from flashdapo.models.packing import use_packed_attention
from flashdapo.models.policy import PolicyModel, make_token_batch
from tests.helpers.moe import one_thread, tiny_moe


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


PROMPTS, RESPONSES = (5, 3, 9), (4, 7, 1)
"""Odd lengths; the last sequence's single response token makes its input the prompt alone."""


def _sequences(vocab: int = 50):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in PROMPTS]
    responses = [torch.randint(3, vocab, (n,), generator=g) for n in RESPONSES]
    return prompts, responses


def _policy_pass(model, packed: bool):
    """(log-probs, router logits, the batch) of the policy's training forward."""
    policy = PolicyModel(model, "sdpa", "torch", 1.0)
    policy.pack = packed
    if packed:
        use_packed_attention(model)
    prompts, responses = _sequences()
    batch = make_token_batch(prompts, responses, torch.device("cpu"), packed)
    routing = RouterLogits()
    logp, _ = policy(batch, routing=routing)
    return logp, routing, batch


def test_aux_loss_per_sequence_equals_transformers_and_its_gradient_reaches_the_routers():
    model = tiny_moe()
    prompts, responses = _sequences()
    lengths = [len(p) + len(r) - 1 for p, r in zip(prompts, responses)]
    # transformers' own: its load-balancing loss of each sequence alone, summed; and its gradient.
    reference, load = 0.0, torch.zeros(2, 4, dtype=torch.float64)
    for p, r in zip(prompts, responses):
        out = model(input_ids=torch.cat([p, r[:-1]])[None], output_router_logits=True)
        reference = reference + out.aux_loss
        assert torch.allclose(out.aux_loss, load_balancing_loss_func(out.router_logits, 4, 2), rtol=0, atol=0)
        for layer, logits in enumerate(out.router_logits):
            load[layer] += torch.bincount(torch.topk(logits, 2).indices.reshape(-1), minlength=4).double()
    reference.backward()
    expected_grads = [gate.weight.grad.clone() for gate in routers(model)]
    model.zero_grad()
    # Uniform router probabilities give top_k = 2 per sequence (E * sum_i f_i * 1/E): these are not uniform.
    assert abs(float(reference.detach()) - 2 * len(prompts)) > 0.1
    for packed in (True, False):
        _, routing, batch = _policy_pass(model, packed)
        ids = token_sequences(len(prompts), batch.bounds, batch.attention_mask)
        assert ids.tolist().count(-1) == (0 if packed else len(ids) - sum(lengths))  # padding left out
        balance = load_balancing(routing.layers, ids, len(prompts), top_k=2)
        # transformers sums its probabilities in float32: agreement to float32 rounding.
        torch.testing.assert_close(balance.loss_sum, reference.detach().double(), rtol=1e-6, atol=0)
        torch.testing.assert_close(balance.load, load, rtol=0, atol=0)
        model.zero_grad()
        balance.loss_sum.backward()
        for gate, expected in zip(routers(model), expected_grads):
            assert expected.abs().max() > 1e-3
            torch.testing.assert_close(gate.weight.grad, expected, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("packed", [True, False])
def test_under_routing_replay_the_loss_and_the_load_count_the_replayed_experts(packed):
    """With the engine's routes replayed, f_i and the expert load count the experts the tokens were dispatched to
    (the records), not the router's own top-k; P_i stays the router's probabilities (the gradient)."""
    model = tiny_moe()
    prompts, responses = _sequences()
    lengths = [len(p) + len(r) - 1 for p, r in zip(prompts, responses)]
    own = [torch.topk(torch.stack(model(input_ids=torch.cat([p, r[:-1]])[None], output_router_logits=True)
                                  .router_logits, dim=1), 2).indices for p, r in zip(prompts, responses)]
    records = [((o + 1) % 4).to(torch.int8) for o in own]  # [positions, layers, 2]: every pick moved
    policy = PolicyModel(model, "sdpa", "torch", 1.0).with_route_replay("r3")
    policy.pack = packed
    if packed:
        use_packed_attention(model)
    batch = make_token_batch(prompts, responses, torch.device("cpu"), packed, routes=records)
    routing = RouterLogits()
    policy(batch, routing=routing)
    assert routing.chosen is not None and len(routing.chosen) == 2
    ids = token_sequences(len(prompts), batch.bounds, batch.attention_mask)
    replayed = load_balancing(routing.layers, ids, len(prompts), top_k=2, chosen=routing.chosen)
    free = load_balancing(routing.layers, ids, len(prompts), top_k=2)
    expected_load = torch.stack([torch.bincount(torch.cat([r[:, layer] for r in records]).long().reshape(-1),
                                                minlength=4) for layer in range(2)]).double()
    torch.testing.assert_close(replayed.load, expected_load, rtol=0, atol=0)
    assert not torch.equal(free.load, replayed.load)
    # The loss from its definition: per sequence, E * sum_i f_i * P_i over the 2 layers, f from the records.
    reference = 0.0
    for i, n in enumerate(lengths):
        rows = (ids == i).nonzero().squeeze(1)
        probs = sum(torch.softmax(layer_logits[rows].double(), -1).sum(0) for layer_logits in routing.layers)
        picks = torch.bincount(records[i].long().reshape(-1), minlength=4).double()
        reference = reference + 4 * (picks / (2 * n) * probs / (2 * n)).sum()
    torch.testing.assert_close(replayed.loss_sum, reference, rtol=1e-12, atol=0)
    policy.route_replay.remove()


def test_a_placeholder_micro_batch_counts_nothing():
    model = tiny_moe()
    policy = PolicyModel(model, "sdpa", "torch", 1.0)
    batch = make_token_batch([torch.tensor([0])], [torch.tensor([0])], torch.device("cpu"), packed=False)
    routing = RouterLogits()
    policy(batch, routing=routing)
    balance = load_balancing(routing.layers, token_sequences(0, None, batch.attention_mask), 0, top_k=2)
    assert float(balance.loss_sum.detach()) == 0 and float(balance.load.sum()) == 0


def test_the_registry_names_the_routers_and_the_shape_keys():
    model = tiny_moe(mlp_only_layers=[0])  # layer 0 dense: one router
    assert routers(model) == [model.model.layers[1].mlp.gate]
    keys = config_keys(model.config)
    assert {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers"} <= set(keys)

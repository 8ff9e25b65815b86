"""GPT-OSS as a mixture-of-experts family (models/hf.py: its `mlp.router` of every block): the router loss of a
tiny GPT-OSS (float64, sinks and a sliding layer) in flashdapo's policy == transformers' own aux_loss of each
sequence alone, gradient into the routers' weights and biases included, and the expert load == its top-k picks;
the torch engine samples from a GPT-OSS whose config turns `output_router_logits` on exactly what it samples
with it off (transformers' load-balancing loss over a KV cache would crash every decode step); routing replay
recomputes GPT-OSS's gate weights (softmax over the k picked logits) exactly. Wall budget: 15 s."""

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM
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
from flashdapo.rollout.base import SamplingParams
from flashdapo.rollout.torch_engine import TorchEngine
from tests.helpers.moe import one_thread

EXPERTS, TOP_K, VOCAB = 4, 2, 50
PROMPTS, RESPONSES = (5, 3, 9), (4, 7, 1)
"""Odd lengths, two past the sliding window; the last sequence's input is its prompt alone."""


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def tiny_gpt_oss(dtype: torch.dtype = torch.float64, **overrides) -> GptOssForCausalLM:
    """A random 2-layer GPT-OSS (4 experts, top-2, a sliding layer of window 4 then a full one, sinks), eager
    attention and experts; routers and sinks scaled up so that routing is far from uniform and sinks matter."""
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                 sliding_window=4, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
                 router_aux_loss_coef=0.01, initializer_range=0.2, experts_implementation="eager")
    model = GptOssForCausalLM(GptOssConfig(**{**shape, **overrides})).to(dtype)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for router in routers(model):
            router.weight.mul_(20.0)
            router.bias.normal_(0.0, 1.0)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model.eval()


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


def _sample(switch: bool):
    model = tiny_gpt_oss(dtype=torch.float32, output_router_logits=switch)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, max_batch=4)
    return engine.generate([[3, 4, 5], [6, 7], [8, 9, 10, 11, 12]], SamplingParams(n=3, max_new_tokens=7, seed=11))


def test_generation_with_output_router_logits_on_samples_what_it_samples_with_it_off():
    on, off = _sample(True), _sample(False)
    assert len(on.response_ids) == 9 and max(len(r) for r in on.response_ids) == 7
    assert [r.tolist() for r in on.response_ids] == [r.tolist() for r in off.response_ids]
    for a, b in zip(on.logprobs, off.logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

"""Qwen3.5's Gated DeltaNet (linear-attention) layers in packed rows: each document runs alone, its conv and
recurrent state starting at zero (flashdapo/models/linear_attention.py). A tiny float64 Qwen3.5 mixing linear
and full attention; documents shorter than the conv kernel (4) and longer than the torch delta rule's chunk
(64). The packed log-probs and gradients equal the padded layout's and transformers' own forward of each
sequence alone; the same packed row run without the bounds reaching the linear layers is far off. Qwen3-Next
(the same layers, MoE blocks) too."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3_5TextConfig, Qwen3NextConfig

from flashdapo.distributed.mesh import SequenceParallelError
from flashdapo.models.hf import config_keys, decoder_layers
from flashdapo.models.linear_attention import (
    SLACK,
    check_sequence_parallel,
    has_linear_attention,
    length_groups,
    linear_attention_modules,
)
from flashdapo.models.packing import packed_attention_kwargs, use_packed_attention
from flashdapo.models.policy import PolicyModel, make_token_batch, per_token_split

VOCAB = 61
CONV = 4
"""The conv kernel (linear_conv_kernel_dim); the torch delta rule's chunk is 64 tokens."""
# (prompt, response) lengths: rows of 2, 3 (< the conv kernel), 71 (> one chunk) and odd others
LENGTHS = [(2, 1), (40, 32), (1, 3), (9, 8), (5, 2)]

SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=6, linear_conv_kernel_dim=CONV,
             layer_types=["linear_attention", "full_attention", "linear_attention"], max_position_embeddings=256)
NEXT = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16)
CONFIGS = {"qwen3_5_text": lambda: Qwen3_5TextConfig(**SHAPE), "qwen3_next": lambda: Qwen3NextConfig(**{**SHAPE, **NEXT})}


def _model(model_type: str = "qwen3_5_text") -> nn.Module:
    torch.manual_seed(0)
    # float64 experts: the loop over experts (grouped_mm takes no float64)
    model = AutoModelForCausalLM.from_config(CONFIGS[model_type](), experts_implementation="eager").double()
    with torch.no_grad():  # logits far from uniform, so that a wrong hidden state shows in the log-probs
        model.lm_head.weight.mul_(20.0)
    return model


def _policy(model, packed: bool) -> PolicyModel:
    policy = PolicyModel(model, "sdpa", "naive", temperature=0.7)
    policy.set_layout(packed, SimpleNamespace(sequence_parallel=1, sp_group=None, sp_rank=0))
    return policy


def _samples():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (p,), generator=g) for p, _ in LENGTHS]
    responses = [torch.randint(0, VOCAB, (r,), generator=g) for _, r in LENGTHS]
    return prompts, responses


def _alone(model, prompt, response) -> torch.Tensor:
    """transformers' own float64 forward of one sequence: its response tokens' log-probs at T = 0.7."""
    logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits / 0.7, dim=-1).gather(1, response[:, None]).squeeze(1)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_packed_equals_padded_equals_transformers_alone(model_type):
    model = _model(model_type).eval()
    reference = copy.deepcopy(model)  # never wrapped
    prompts, responses = _samples()
    results = {}
    with torch.no_grad():
        for packed in (True, False):
            policy = _policy(model, packed)
            batch = policy.token_batch(prompts, responses, torch.device("cpu"))
            assert (batch.bounds is not None) == packed
            results[packed] = per_token_split(policy(batch)[0], batch)
        assert len(linear_attention_modules(model)) == model.config.layer_types.count("linear_attention")
        for p, r, packed, padded in zip(prompts, responses, results[True], results[False]):
            expected = _alone(reference, p, r)
            # The delta rule and its gated norm run in fp32 inside HF's layer: that is the noise floor.
            torch.testing.assert_close(packed.double(), expected, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(padded.double(), expected, atol=1e-6, rtol=1e-6)


def test_without_the_bounds_the_linear_layers_mix_documents():
    """The packed row through the unwrapped model (attention per document, linear layers over the whole row):
    the first document is right (causal), every later one is far off. This is what the test above rules out."""
    model = _model().eval()
    use_packed_attention(model)  # full attention per document; it wraps the linear layers too:
    for module in linear_attention_modules(model):
        del module.forward  # back to the class's forward, HF's own over the whole row
    prompts, responses = _samples()
    with torch.no_grad():
        batch = make_token_batch(prompts, responses, torch.device("cpu"), packed=True)
        hidden = model.model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                             **packed_attention_kwargs(model, batch.bounds)).last_hidden_state
        logits = model.lm_head(hidden[0, batch.predict_index]) / 0.7
        logp = torch.log_softmax(logits, dim=-1).gather(1, batch.targets[:, None]).squeeze(1)
        errors = [(lp - _alone(model, p, r)).abs().max().item()
                  for p, r, lp in zip(prompts, responses, per_token_split(logp, batch))]
    assert errors[0] < 1e-6
    assert min(errors[1:]) > 1e-3, errors  # 1000 times the tolerance above


def test_packed_backward_equals_padded_gradients():
    prompts, responses = _samples()
    weights = torch.randn(sum(len(r) for r in responses), generator=torch.Generator().manual_seed(3))
    grads = {}
    for packed in (True, False):
        model = _model().train()
        policy = _policy(model, packed)
        logp, _ = policy(policy.token_batch(prompts, responses, torch.device("cpu")))
        (logp * weights).sum().backward()
        grads[packed] = {name: p.grad for name, p in model.named_parameters()}
    conv = "model.layers.0.linear_attn.conv1d.weight"
    assert grads[True][conv] is not None and grads[True][conv].abs().sum() > 0  # the wrapped path is differentiated
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_sampling_with_a_cache_is_hf_own():
    """A packed policy's model samples through HF's layer unchanged: prefill and decode with its cache of conv
    and recurrent states give the unwrapped model's logits bit for bit."""
    model = _model().eval()
    reference = copy.deepcopy(model)
    policy = _policy(model, packed=True)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
        outs = [policy(input_ids=ids, use_cache=True, cache=caches[0]).logits,
                reference(input_ids=ids, use_cache=True, past_key_values=caches[1]).logits]
        assert torch.equal(outs[0], outs[1])
        step = outs[0][:, -1:].argmax(-1)
        assert torch.equal(policy(input_ids=step, use_cache=True, cache=caches[0]).logits,
                           reference(input_ids=step, use_cache=True, past_key_values=caches[1]).logits)


def test_sequence_parallel_is_refused_in_one_line():
    policy = PolicyModel(_model(), "sdpa", "naive", temperature=1.0)
    with pytest.raises(SequenceParallelError, match=r"trainer.sequence_parallel 2: qwen3_5_text's linear-attention"):
        policy.set_layout(True, SimpleNamespace(sequence_parallel=2, sp_group=None, sp_rank=0))


def test_the_planner_refuses_it_from_config_json():
    """config.json dicts (the launch planner's input), a multimodal Qwen3.5's text config included."""
    layer_types = {"layer_types": ["linear_attention", "full_attention"]}
    for config in ({"model_type": "qwen3_next", **layer_types}, {"model_type": "qwen3_5", "text_config": layer_types}):
        with pytest.raises(SequenceParallelError, match=f"sequence_parallel 4: {config['model_type']}'s linear"):
            check_sequence_parallel(config, 4)
        check_sequence_parallel(config, 1)
    check_sequence_parallel({"model_type": "qwen2", "layer_types": ["full_attention"]}, 4)


def test_registry_entry():
    model = _model()
    assert has_linear_attention(model.config)
    assert len(decoder_layers(model)) == 3
    assert {"layer_types", "linear_num_value_heads", "linear_key_head_dim"} <= set(config_keys(model.config))


@pytest.mark.parametrize(("lengths", "calls"), [([3, 76, 3, 16, 100, 6], 3), ([7, 200, 1, 30, 2], 3),
                                               ([8000] + [400] * 20, 2), ([5], 1), ([4, 4, 4], 1)])
def test_length_groups_bound_the_padding_in_few_calls(lengths, calls):
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    pads = sum(len(g) * max(lengths[i] for i in g) - sum(lengths[i] for i in g) for g in groups)
    assert pads <= SLACK * sum(lengths)
    assert len(groups) == calls  # one batch of all 21 documents of the third row would be 8 times its tokens

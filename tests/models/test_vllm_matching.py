"""models/vllm_matching.py: the decoder laid out as vLLM's batch-invariant forward (merged q/k/v and gate/up,
the residual kernel's norms, vLLM's rotary, attention per document), computed with the reference (torch)
operations, equals transformers' own forward and gradients, in float64 on a packed row of three documents.
The same layout with vLLM's CUDA kernels is the GPU path (tests/rollout/test_exact_on_policy_vllm.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from flashdapo.errors import ConfigError
from flashdapo.models.packing import DocumentBounds, packed_attention_kwargs
from flashdapo.models.vllm_matching import make_vllm_matching, vllm_matching_refusal
from flashdapo.models.vllm_matching_ops import reference_ops, vllm_ops

SIZES = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _model(family: str):
    torch.manual_seed(0)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=16, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 1000.0}))
    elif family == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**SIZES, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SIZES, rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    with torch.no_grad():  # norms away from 1, biases away from 0: a swapped or dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.config._attn_implementation = "sdpa"
    return model.double()


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_the_matching_layout_equals_transformers_forward_and_gradients(family):
    hf = _model(family)
    matched = copy.deepcopy(hf)
    make_vllm_matching(matched, reference_ops(hf.config.rope_parameters["rope_theta"]))
    lengths = [7, 12, 5]
    docs = [torch.randint(0, SIZES["vocab_size"], (n,)) for n in lengths]
    probe = torch.randn(sum(lengths), SIZES["hidden_size"], dtype=torch.float64)

    expected = torch.cat([hf.model(input_ids=d[None], use_cache=False).last_hidden_state[0] for d in docs])
    (expected * probe).sum().backward()

    bounds = DocumentBounds.from_lengths(lengths, "cpu")
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    got = matched.model(input_ids=torch.cat(docs)[None], position_ids=positions, use_cache=False,
                        **packed_attention_kwargs(matched, bounds)).last_hidden_state[0]
    (got * probe).sum().backward()

    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # HF's norms compute in fp32 even in a float64 model, and so does autograd through them: the gradients
    # agree to fp32's precision (a wrong backward would miss by O(1)).
    reference = dict(hf.named_parameters())
    for name, p in matched.named_parameters():
        if reference[name].grad is None:  # the LM head: not in this forward
            continue
        scale = reference[name].grad.abs().max().item()
        assert (p.grad - reference[name].grad).abs().max().item() <= 1e-6 * scale, name


def test_a_padded_call_is_refused_in_one_line():
    matched = _model("qwen3")
    make_vllm_matching(matched, reference_ops(1000.0))
    with pytest.raises(ConfigError, match="packed rows only"):
        matched(input_ids=torch.zeros(2, 5, dtype=torch.long))


def test_families_it_does_not_lay_out_are_named():
    assert vllm_matching_refusal(_model("qwen3")) is None
    windowed = _model("qwen2")
    windowed.config.use_sliding_window = True
    assert vllm_matching_refusal(windowed) == "sliding-window attention layers"
    from transformers import Phi3Config, Phi3ForCausalLM

    phi = Phi3ForCausalLM(Phi3Config(**SIZES, pad_token_id=0, eos_token_id=1, bos_token_id=1))
    assert "model type phi3" in vllm_matching_refusal(phi)
    with pytest.raises(ConfigError, match="use rollout.engine torch"):
        make_vllm_matching(phi, reference_ops(1e4))
    from flashdapo.config import LoraConfig
    from flashdapo.models.lora import add_adapters

    adapted = _model("qwen3")
    add_adapters(adapted, LoraConfig(rank=4), 0)
    assert vllm_matching_refusal(adapted).startswith("LoRA adapters")


def test_vllms_kernels_are_refused_off_cuda_in_one_line():
    with pytest.raises(ConfigError, match="needs CUDA"):
        vllm_ops(_model("qwen3"), torch.device("cpu"))

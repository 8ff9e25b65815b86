"""The policy applies a model's final-logit softcap inside the LM-head kernels: its log-probs of a tiny Gemma 2
(final_logit_softcapping set) equal transformers' own float64 forward, log-softmax of the capped logits / T."""

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from flashdapo.models.hf import final_logit_softcap
from flashdapo.models.policy import PolicyModel, per_token_split


def _gemma2(cap: float | None) -> Gemma2ForCausalLM:
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                       final_logit_softcapping=cap, attn_logit_softcapping=None, sliding_window=256)
    model = Gemma2ForCausalLM(cfg).double().eval()
    with torch.no_grad():  # logits large enough that the cap bends them
        model.lm_head.weight.mul_(40.0)
    return model


@pytest.mark.parametrize("impl", ["naive", "torch"])
@pytest.mark.parametrize("cap", [3.0, 30.0])
def test_softcapped_logprobs_equal_transformers_float64(cap, impl):
    model = _gemma2(cap)
    assert final_logit_softcap(model.config) == cap
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 67, (n,), generator=g) for n in (5, 3)]
    responses = [torch.randint(0, 67, (n,), generator=g) for n in (6, 4)]
    policy = PolicyModel(model, "eager", impl, temperature=0.7)
    with torch.no_grad():
        batch = policy.token_batch(prompts, responses, torch.device("cpu"))
        logp, _ = policy(batch)
        for p, r, lp in zip(prompts, responses, per_token_split(logp, batch)):
            logits = model(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1:-1]  # capped by HF itself
            expected = torch.log_softmax(logits / 0.7, dim=-1).gather(1, r[:, None]).squeeze(1)
            torch.testing.assert_close(lp.double(), expected, atol=1e-5, rtol=1e-5)


def test_without_a_cap_the_policy_passes_none():
    assert PolicyModel(_gemma2(None), "eager", "naive", temperature=1.0).softcap is None

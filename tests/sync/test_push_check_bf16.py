"""The push check with bf16 weights (sync/check.py): the probe draws only the tokenizer's
ids, the fp32 reference is the model's own forward, and the measured tolerance passes a correct push while
failing a push that left a decoder layer scaled by 1.01, a layer or a tied head holding other values.

The engine here is a double of what vLLM runs: a bf16 copy of the policy run with another attention kernel
(eager, the trainer runs sdpa) and an fp32 head. Real vLLM (its CPU build) in bf16: tests/vllm/test_vllm_padded_vocab.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from flashdapo.models.policy import PolicyModel
from flashdapo.sync.check import (
    MEAN_FACTOR,
    PROBE_LENGTH,
    PROBE_SEQUENCES,
    PushCheck,
    PushMismatchError,
    reference_logprobs,
)
from tests.helpers.push_doubles import BF16ScoringEngine
from tests.vllm.padded_vocab import FAMILIES, family_config, hf_model

VOCAB, TOKENS = 4160, 4096  # 64 rows of padding past the tokenizer, as Qwen2.5's 399
CPU = torch.device("cpu")


class BF16Engine(BF16ScoringEngine):
    """vLLM's scoring as the check sees it: an fp32 head over bf16 hidden states, eager attention."""

    def __init__(self, model):
        super().__init__(model)
        self.model.config._attn_implementation = "eager"

    @torch.no_grad()
    def score(self, sequences):
        ids = torch.tensor(sequences)
        hidden = self.model.model(input_ids=ids).last_hidden_state.float()
        logits = hidden @ self.model.lm_head.weight.float().T
        return list(torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0])


def _policy(family, tied, hidden=64, layers=2, vocab=VOCAB):
    config = family_config(family, hidden=hidden, layers=layers, vocab=vocab, tied=tied, head_dim=32)
    model = hf_model(config).to(torch.bfloat16)
    return PolicyModel(model, "sdpa", "torch", temperature=0.8), config


def test_the_probe_draws_only_the_tokenizers_ids():
    policy, _ = _policy("qwen2", False)
    padded = PushCheck(policy, CPU, VOCAB, lambda _m: None, tokenizer_size=TOKENS).probe
    assert len(padded) == PROBE_SEQUENCES and {len(s) for s in padded} == {PROBE_LENGTH}
    ids = [t for s in padded for t in s]
    assert max(ids) < TOKENS and max(ids) > 0.9 * TOKENS  # the whole tokenizer, none of the padding
    assert PushCheck(policy, CPU, 48, lambda _m: None, tokenizer_size=100).probe == \
        PushCheck(policy, CPU, 48, lambda _m: None).probe  # a tokenizer larger than the model: the model's rows


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_the_reference_is_the_fp32_forward_on_the_rounded_weights(family, tied):
    policy, _ = _policy(family, tied)
    exact = copy.deepcopy(policy.hf).float()
    sequences = torch.randint(0, TOKENS, (3, 10), generator=torch.Generator().manual_seed(0)).tolist()
    ids = torch.tensor(sequences)
    with torch.no_grad():
        expected = torch.log_softmax(exact(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    got = torch.stack(reference_logprobs(policy.hf, sequences, CPU, torch.bfloat16))
    assert (got - expected).abs().max() < 1e-5


def _scale_layer(factor):
    def change(model):
        for p in model.model.layers[1].parameters():
            p.mul_(factor)
    return change


def _other_layer(model):
    other = hf_model(model.config, seed=7).to(torch.bfloat16)
    model.model.layers[1].load_state_dict(other.model.layers[1].state_dict())


def _stale_tied_head(model):
    """The head keeps other values than the embedding it is tied to (vLLM's packed copy left unrefreshed)."""
    other = hf_model(model.config, seed=7).to(torch.bfloat16)
    model.lm_head.weight = torch.nn.Parameter(other.model.embed_tokens.weight.detach().clone())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_correct_bf16_push_passes_and_a_wrong_one_fails(family):
    tied = family == "qwen2"
    policy, _ = _policy(family, tied, hidden=256, layers=3)
    lines: list[str] = []
    check = PushCheck(policy, CPU, VOCAB, lines.append, tokenizer_size=TOKENS)
    check(BF16Engine(policy.hf))  # the first push measures the tolerance
    calibration = check.calibration
    assert calibration is not None and calibration.mean > 0
    assert lines[0].startswith(f"push check calibrated on {PROBE_SEQUENCES * (PROBE_LENGTH - 1)} fixed tokens")
    assert "weight push 1 checked: max |logp_vllm - logp_trainer|" in lines[1]
    assert check.last_mean < MEAN_FACTOR * calibration.mean  # a correct push: about the trainer's own error
    assert policy.temperature == 0.8
    cases = {"layers.1 x1.01": (_scale_layer(1.01), "layers.1"), "layers.1 from another init": (_other_layer, "layers.1")}
    if tied:
        cases["stale tied head"] = (_stale_tied_head, "lm_head")
    for name, (change, culprit) in cases.items():
        engine = BF16Engine(policy.hf)
        with torch.no_grad():
            change(engine.model)
        with pytest.raises(PushMismatchError) as err:
            check(engine)
        message = str(err.value)
        assert "\n" not in message and "bfloat16 weights" in message, name
        assert "x the trainer's own bfloat16 error on these tokens against fp32 arithmetic" in message
        assert message.split("max |delta logp|): ")[1].split(" (")[0] == culprit, (name, message)
    check(BF16Engine(policy.hf))  # a correct push after them passes again, against the same calibration
    assert check.calibration is calibration

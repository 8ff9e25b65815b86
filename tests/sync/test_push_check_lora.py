"""The push check of a policy with LoRA adapters (sync/check.py), without vLLM: the calibration's fp32
reference runs the plain model on base + alpha/r B A merged from the weights as the engine holds them, a correct
bf16 push of the adapted model passes against it and adapters the engine lacks fail; and an engine that reports
the digest of the adapters it was given fails the check as soon as the trainer's adapters move on, by however
little. Real vLLM: tests/sync/test_vllm_lora.py."""

from __future__ import annotations

import copy

import pytest
import torch

from flashdapo.config import LoraConfig
from flashdapo.models.lora import add_adapters
from flashdapo.models.policy import PolicyModel
from flashdapo.sync.check import (
    PushCheck,
    PushMismatchError,
    adapter_digest,
    reference_logprobs,
    trainer_adapters,
)
from flashdapo.sync.check import _merged_reference as merged_reference
from tests.helpers.push_doubles import BF16ScoringEngine, ScoringEngine
from tests.vllm.padded_vocab import family_config, hf_model

VOCAB = 512
CPU = torch.device("cpu")


def _adapted(dtype=torch.bfloat16, scale=0.05):
    """A 2-layer Qwen2 in `dtype` with rank-8 adapters (fp32) whose B holds a draw of `scale`."""
    config = family_config("qwen2", hidden=64, layers=2, vocab=VOCAB, tied=False, head_dim=32)
    model = hf_model(config).to(dtype)
    add_adapters(model, LoraConfig(rank=8), seed=0)
    _draw_b(model, 1, scale)
    return PolicyModel(model, "sdpa", "torch", temperature=0.8)


def _draw_b(model, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)


def test_the_reference_of_an_adapted_policy_is_the_fp32_forward_on_its_rounded_weights():
    policy = _adapted()
    exact = copy.deepcopy(policy.hf)
    with torch.no_grad():
        for param in exact.parameters():
            param.data = param.data.to(torch.bfloat16).float()  # the adapters as vLLM holds them: bf16
    sequences = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0)).tolist()
    ids = torch.tensor(sequences)
    with torch.no_grad():
        expected = torch.log_softmax(exact(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    got = torch.stack(reference_logprobs(policy.hf, sequences, CPU, torch.bfloat16,
                                         merged_reference(policy.hf, torch.bfloat16)))
    assert (got - expected).abs().max() < 1e-4


def test_a_correct_bf16_push_of_the_adapted_model_passes_and_missing_adapters_fail():
    policy = _adapted()
    lines: list[str] = []
    check = PushCheck(policy, CPU, VOCAB, lines.append)
    check(BF16ScoringEngine(policy.hf))  # calibrates against the merged fp32 reference
    assert check.calibration is not None and check.calibration.mean > 0, lines
    assert "weight push 1 checked" in lines[1]
    stale = BF16ScoringEngine(policy.hf)
    _draw_b(stale.model, 2, 0.05)  # the engine holds other adapters
    with pytest.raises(PushMismatchError, match="beyond .* for bfloat16 weights"):
        check(stale)
    check(BF16ScoringEngine(policy.hf))


class DigestEngine(ScoringEngine):
    """An fp32 copy of the adapted policy that reports the digest of the adapters it was given, as vLLM's
    engine does under LoRA."""

    def __init__(self, model):
        super().__init__(model)
        self.adapter_digest = adapter_digest(trainer_adapters(model))


def test_the_digest_fails_adapters_the_trainer_moved_on_from_however_little():
    policy = _adapted(torch.float32)
    check = PushCheck(policy, CPU, VOCAB, lambda _m: None)
    engine = DigestEngine(policy.hf)
    check(engine)
    with torch.no_grad():
        for name, param in policy.hf.named_parameters():
            if "lora_B" in name:
                param.add_(1e-7)
    with pytest.raises(PushMismatchError, match="holds other LoRA adapters than the trainer's: the digest"):
        check(engine)
    assert check.last_max < 1e-5  # what log-probs alone would have let through
    check(DigestEngine(policy.hf))
    engine.adapter_digest = None
    with pytest.raises(PushMismatchError, match="holds other LoRA adapters than the trainer's: it was given none"):
        check(engine)

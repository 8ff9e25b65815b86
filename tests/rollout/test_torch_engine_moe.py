"""The torch engine samples from a Qwen3-MoE or a GPT-OSS whose config.json turns `output_router_logits` on:
transformers would then compute its load-balancing loss on every decode step, over router logits of the new tokens
and an attention mask of every cache slot, and fail; the engine turns the switch off for sampling, and samples
exactly what it samples with the switch off."""

import pytest
import torch

from flashdapo.rollout.base import SamplingParams
from flashdapo.rollout.torch_engine import TorchEngine
from tests.helpers.moe import one_thread, tiny_gpt_oss, tiny_moe


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11, 12]]


MODELS = {"qwen3_moe": lambda switch: tiny_moe(dtype=torch.float32, output_router_logits=switch,
                                               experts_implementation="grouped_mm"),
          "gpt_oss": lambda switch: tiny_gpt_oss(dtype=torch.float32, output_router_logits=switch)}


def _sample(family: str, switch: bool):
    engine = TorchEngine(MODELS[family](switch), eos_token_ids=[1], pad_token_id=0, max_batch=4)
    return engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=7, seed=11))


@pytest.mark.parametrize("family", MODELS)
def test_generation_with_output_router_logits_on_samples_what_it_samples_with_it_off(family):
    on, off = _sample(family, True), _sample(family, False)
    assert len(on.response_ids) == 9 and max(len(r) for r in on.response_ids) == 7
    assert [r.tolist() for r in on.response_ids] == [r.tolist() for r in off.response_ids]
    for a, b in zip(on.logprobs, off.logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

"""The push check (sync/check.py) against an engine holding a copy of the policy: a faithful copy passes, a
stale group is named; an engine that cannot record its groups' outputs still fails the push, saying so."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashdapo.models.policy import PolicyModel
from flashdapo.sync.check import PushCheck, PushMismatchError
from tests.helpers.push_doubles import ScoringEngine


class CopyEngine(ScoringEngine):
    """A rollout engine whose 'vLLM' model is an fp32 copy of the policy's HF model (as a push would leave it):
    `score` and `group_outputs` (through vLLM's recorder, sync/vllm.py) run on the copy, so the check and its
    localization see what it holds."""

    display_name = "vLLM"


def _policy(tied):
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied))
    return PolicyModel(hf, "sdpa", "torch", temperature=0.7)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("stale, culprit", [(None, None), ("model.layers.1.mlp.down_proj.weight", "layers.1"),
                                            ("lm_head.weight", "lm_head"), ("model.norm.weight", "norm")])
def test_push_check_passes_a_faithful_engine_and_names_what_differs(tied, stale, culprit):
    policy = _policy(tied)
    engine = CopyEngine(policy.hf)
    lines = []
    check = PushCheck(policy, torch.device("cpu"), 48, lines.append)
    if stale is None:
        check(engine)
        assert check.last_max < 1e-5 and len(lines) == 1 and "weight push 1 checked" in lines[0]
        assert policy.temperature == 0.7  # put back after the temperature-1 probe
        return
    if stale == "lm_head.weight" and tied:  # a tied head whose own (packed) copy was not refreshed
        engine.model.lm_head.weight = torch.nn.Parameter(engine.model.lm_head.weight.detach().clone())
    with torch.no_grad():
        param = dict(engine.model.named_parameters())[stale] if stale != "lm_head.weight" else \
            engine.model.lm_head.weight
        param.add_(0.3 * torch.randn_like(param))
    with pytest.raises(PushMismatchError) as err:
        check(engine)
    message = str(err.value)
    groups = message.split("max |delta logp|): ")[1].split(";")[0]
    assert groups.split(" (")[0] == culprit, message
    assert "\n" not in message and "float32" in message



class OpaqueEngine(CopyEngine):
    """An engine with its own weights that records no group outputs (the torch-compiled kind)."""

    display_name = "Opaque"
    group_outputs = None


def test_an_engine_without_group_outputs_still_fails_the_push_and_says_why():
    policy = _policy(tied=True)
    engine = OpaqueEngine(policy.hf)
    with torch.no_grad():
        engine.model.model.norm.weight.add_(0.3)
    with pytest.raises(PushMismatchError, match="after weight push 1 Opaque's log-probs .* Opaque records no "
                                                "parameter group's output, so the groups are not named"):
        PushCheck(policy, torch.device("cpu"), 48, lambda _m: None)(engine)

"""The one source of the policy's weights (sync/__init__.py): what an engine wakes on, what the export writes, the
version it is given; and the registry owning how an engine takes each family's experts (sync/vllm.py)."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashdapo.models.hf import FAMILIES
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.sync import WeightSource, policy_weights
from flashdapo.sync.vllm import ENGINE_EXPERTS


def _model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1))


class RecordingEngine:
    def __init__(self):
        self.woken = []

    def wake(self, weights, version):
        self.woken.append((dict(weights(torch.bfloat16)), version))


def test_an_engine_wakes_on_the_policys_tensors_at_the_current_version():
    hf = _model()
    source, engine = policy_weights(hf, "float32"), RecordingEngine()
    source.wake(engine)
    source.advance()
    source.wake(engine)
    want = dict(iter_full_state_dict(hf, dtype=torch.bfloat16))
    assert [version for _, version in engine.woken] == [0, 1]
    for tensors, _ in engine.woken:
        assert tensors.keys() == want.keys() and all(torch.equal(tensors[n], want[n]) for n in want)


def test_the_export_is_in_the_compute_dtype():
    hf = _model()
    assert {t.dtype for _, t in policy_weights(hf, "bfloat16").export()} == {torch.bfloat16}
    exported = dict(WeightSource(hf).export())
    assert all(torch.equal(exported[n], t) for n, t in hf.state_dict().items() if n in exported)
    assert {t.dtype for t in exported.values()} == {torch.float32}


def test_every_mixture_of_experts_family_says_how_an_engine_takes_its_experts():
    """A new MoE family is one registry entry: its engine_experts names one of the stream layouts the vLLM push
    knows, and a dense family streams its tensors as held."""
    for family in FAMILIES.values():
        assert family.engine_experts in ENGINE_EXPERTS, family.model_type
        assert (family.engine_experts is None) == (family.routers is None), family.model_type

"""The trainer-vs-engine log-prob check: its schedule, its figures, its warning."""

import warnings

import pytest
import torch

from flashdapo.config import AlgorithmConfig, RolloutConfig
from flashdapo.trainer.batch import Group, build_train_batch
from flashdapo.trainer.observe.logprob_check import (
    LogprobMismatchWarning,
    logprob_agreement,
    should_check_logprobs,
)


def test_logprob_check_schedule():
    assert [s for s in range(12) if should_check_logprobs(s, 5)] == [0, 5, 10]
    assert [s for s in range(12) if should_check_logprobs(s, 0)] == [0]
    assert [s for s in range(3, 12) if should_check_logprobs(s, 4, first_step=3)] == [3, 7, 11]


def _batch(sampled, old):
    """One group per response; the engine reported `sampled`, the trainer recomputed `old`."""
    groups = [Group(torch.tensor([1]), [torch.zeros(len(o), dtype=torch.long)], torch.zeros(1),
                    torch.zeros(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool),
                    sampler_logprobs=None if s is None else [s]) for s, o in zip(sampled, old)]
    return build_train_batch([groups], old, AlgorithmConfig())


def test_agreement_reports_mean_and_max_and_warns_above_threshold():
    old = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0])]
    sampled = [torch.tensor([-1.1, -2.0, -0.2]), torch.tensor([-3.4])]
    rollout = RolloutConfig(logprob_check_every=2, logprob_check_threshold=0.1)
    with pytest.warns(LogprobMismatchWarning, match="exceeds rollout.logprob_check_threshold=0.1"):
        metrics = logprob_agreement(1, _batch(sampled, old), rollout, warn=True)
    assert metrics["rollout/logprob_abs_diff_mean"] == pytest.approx((0.1 + 0.0 + 0.3 + 0.4) / 4)
    assert metrics["rollout/logprob_abs_diff_max"] == pytest.approx(0.4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert logprob_agreement(1, _batch(sampled, old), rollout, warn=False)  # figures without a warning
        assert logprob_agreement(2, _batch(sampled, old), rollout, warn=True) == {}  # not scheduled
        assert logprob_agreement(3, _batch(old, old), rollout, warn=True)["rollout/logprob_abs_diff_max"] == 0
        # An engine that reports no log-probs (for some response) gives nothing to compare.
        assert logprob_agreement(1, _batch([None, sampled[1]], old), rollout, warn=True) == {}


class CopyEngine:
    """A rollout engine whose 'vLLM' model is a copy of the policy's HF model (as a push would leave it):
    `score` and `llm.apply_model` run on the copy, so the check and its localization see what it holds."""

    weight_dtype = torch.float32

    def __init__(self, hf):
        import copy

        self.model = copy.deepcopy(hf)
        self.llm = self

    def apply_model(self, fn):
        return [fn(self.model)]

    @torch.no_grad()
    def score(self, sequences):
        out = []
        for s in sequences:
            logits = self.model(torch.tensor([s])).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
        return out


def _policy(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flashdapo.models.policy import PolicyModel

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied))
    return PolicyModel(hf, "sdpa", "torch", temperature=0.7)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("stale, culprit", [(None, None), ("model.layers.1.mlp.down_proj.weight", "layers.1"),
                                            ("lm_head.weight", "lm_head"), ("model.norm.weight", "norm")])
def test_push_check_passes_a_faithful_engine_and_names_what_differs(tied, stale, culprit):
    from flashdapo.trainer.observe.logprob_check import PushCheck, PushMismatchError

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

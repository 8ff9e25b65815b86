"""Exact on-policy (trainer.batch_invariant, models/invariant.py): the torch engine's sampled-token log-probs
are the trainer's, bit for bit. Generation with two batch sizes and a refilled stream, the old log-probs packed
and padded with two micro-batch budgets, and the update's fused sweep: torch.equal everywhere, fp32 and bf16.
The controls: the same policy without the flag parts engine and trainer on some token; a one-ulp change of one
weight between sampling and scoring is seen."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from flashdapo.config import ConfigError
from flashdapo.distributed.mesh import DistEnv
from flashdapo.models.invariant import make_batch_invariant
from flashdapo.models.policy import PolicyModel
from flashdapo.rollout.base import SamplingParams
from flashdapo.rollout.torch_engine import TorchEngine

CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, mesh=None)
VOCAB, EOS, PAD = 97, 3, 0
TEMPERATURE = 0.9


def _policy(dtype: torch.dtype, invariant: bool, pack: bool = True, seed: int = 0,
            device: torch.device = CPU) -> PolicyModel:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    policy = PolicyModel(hf, "sdpa", "auto", TEMPERATURE)  # auto: the torch kernels here, Triton's on CUDA
    if invariant:
        make_batch_invariant(policy)
    policy.set_layout(pack, DistEnv(rank=0, local_rank=0, world_size=1, device=device, mesh=None))
    return policy


def _prompts(count: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 30, (count,), generator=gen).tolist()
    return [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _sample(policy: PolicyModel, prompts, max_batch: int, new_tokens: int = 24):
    engine = TorchEngine(policy, [EOS], PAD, next(policy.parameters()).device, max_batch=max_batch)
    sampling = SamplingParams(n=2, temperature=TEMPERATURE, max_new_tokens=new_tokens, seed=7)
    return engine.generate(prompts, sampling)


def _scored(policy: PolicyModel, rollouts, budget: int, loss: bool = False) -> list[torch.Tensor]:
    """The trainer's log-probs of every response, in micro-batches of about `budget` tokens (the old-log-prob
    pass), or from the update's fused sweep (`loss`)."""
    out, start = [], 0
    prompts, responses = rollouts.prompt_ids, rollouts.response_ids
    while start < len(responses):
        end, tokens = start, 0
        while end < len(responses) and (end == start or tokens + len(prompts[end]) + len(responses[end]) <= budget):
            tokens += len(prompts[end]) + len(responses[end])
            end += 1
        batch = policy.token_batch(prompts[start:end], responses[start:end], next(policy.parameters()).device)
        with torch.no_grad():
            if loss:
                _, logp, _ = policy(batch, loss_fn=lambda lp, rows: lp.sum())
            else:
                logp, _ = policy(batch)
        out += list(torch.split(logp.cpu(), batch.token_counts))
        start = end
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[int, int]:
    """(bit-equal tokens, tokens)."""
    return sum(int((x.cpu() == y.cpu()).sum()) for x, y in zip(a, b, strict=True)), sum(x.numel() for x in a)


# The CUDA cases are written for a lent GPU (bench/gpu_check.py runs `-m cuda`) and have not run yet: whether
# cuBLAS gives a row the same bits over whole 16-row tiles is what they find out (make_batch_invariant refuses
# in one line where it does not).
ON_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=ON_CUDA)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_engine_and_trainer_log_probs_are_bit_equal_with_batch_invariance(dtype, device):
    device = torch.device(device)
    policy = _policy(dtype, invariant=True, device=device)
    prompts = _prompts(9)
    # one batch of all 18 sequences, and a stream of 5 rows refilled as rows finish
    wide, narrow = _sample(policy, prompts, max_batch=18), _sample(policy, prompts, max_batch=5)
    assert min(sum(len(r) for r in rollouts.response_ids) for rollouts in (wide, narrow)) > 150
    padded = _policy(dtype, invariant=True, pack=False, device=device)
    padded.load_state_dict(policy.state_dict())
    for rollouts in (wide, narrow):
        for scorer, budget, loss in [(policy, 4096, False), (policy, 60, False), (padded, 200, False),
                                     (policy, 4096, True)]:
            equal, total = _equal(_scored(scorer, rollouts, budget, loss), rollouts.logprobs)
            assert equal == total, (dtype, budget, scorer.packed_layout, loss, equal, total)


def test_without_batch_invariance_some_token_differs():
    policy = _policy(torch.float32, invariant=False)
    rollouts = _sample(policy, _prompts(9), max_batch=18)
    equal, total = _equal(_scored(policy, rollouts, 4096), rollouts.logprobs)
    assert equal < total


def test_a_one_ulp_change_of_one_weight_between_sampling_and_scoring_is_seen():
    policy = _policy(torch.float32, invariant=True)
    rollouts = _sample(policy, _prompts(9), max_batch=18)
    changed = copy.deepcopy(policy)
    with torch.no_grad():
        weight = changed.hf.model.norm.weight  # one value every token's last hidden state is scaled by
        weight[0] = torch.nextafter(weight[0], torch.tensor(float("inf")))
    equal, total = _equal(_scored(changed, rollouts, 4096), rollouts.logprobs)
    assert equal < total


def test_a_family_it_does_not_cover_is_refused_in_one_line():
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
                         max_window_layers=1)
    hf = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError) as err:
        make_batch_invariant(PolicyModel(hf, "sdpa", "torch", 1.0))
    assert "qwen2's sliding-window attention layers are not covered" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_with_the_engines_log_probs_equals_one_with_recomputed_ones_bit_for_bit(tmp_path, monkeypatch,
                                                                                        dtype):
    """trainer.batch_invariant: a training step of the tiny toy (2 mini-batches) with old_logprobs=rollout
    equals the step that recomputes pi_old, every weight to the bit, and its check finds every token equal;
    the first mini-batch's importance ratio is exactly 1 (its mean over the mini-batch's tokens)."""
    from flashdapo.trainer import update
    from tests.helpers.runs import first_step_weights, tiny_config

    ratios = []
    real_loss = update.token_loss

    def recording_loss(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        ratios.append(float(stats.ratio) / max(float(stats.num_tokens), 1.0))
        return loss, stats

    common = dict(trainer={"batch_invariant": True}, model={"dtype": dtype})
    monkeypatch.setattr(update, "token_loss", recording_loss)
    rollout, w_rollout = first_step_weights(tiny_config(tmp_path / "rollout", algorithm={"old_logprobs": "rollout"},
                                                        **common), monkeypatch)
    first_ratio = ratios[0]
    recomputed, w_recomputed = first_step_weights(tiny_config(tmp_path / "recompute", **common), monkeypatch)
    assert rollout["rollout/logprob_exact_fraction"] == 1.0 and rollout["rollout/logprob_abs_diff_max"] == 0.0
    assert recomputed["rollout/logprob_exact_fraction"] == 1.0
    assert first_ratio == 1.0
    assert len(w_rollout) == len(w_recomputed)
    local = [[w.to_local() if hasattr(w, "to_local") else w for w in ws] for ws in (w_rollout, w_recomputed)]
    assert all(torch.equal(a, b) for a, b in zip(*local))
    assert rollout["actor/grad_norm"] == recomputed["actor/grad_norm"] > 0


def test_a_differing_token_stops_the_run_in_one_line_naming_it(tmp_path, monkeypatch):
    """The scheduled check recomputes pi_old; a recomputation one ulp off on one token (here by hand) stops the
    step naming the response, the position and both values."""
    from flashdapo.trainer import loop
    from flashdapo.trainer.observe.logprob_check import OffPolicyError
    from tests.helpers.runs import first_step_weights, tiny_config

    real = loop.compute_old_logprobs

    def one_off(*args, **kwargs):
        out = real(*args, **kwargs)
        out[1][2] = torch.nextafter(out[1][2], torch.tensor(0.0))
        return out

    monkeypatch.setattr(loop, "compute_old_logprobs", one_off)
    cfg = tiny_config(tmp_path, algorithm={"old_logprobs": "rollout"}, trainer={"batch_invariant": True})
    with pytest.raises(OffPolicyError) as err:
        first_step_weights(cfg, monkeypatch)
    line = str(err.value)
    assert "\n" not in line and "step 1: trainer.batch_invariant" in line
    assert "first: response 1 of this rank's batch" in line and "token 2: engine -" in line


@pytest.mark.parametrize("changes,named", [
    ({"rollout": {"engine": "vllm", "tensor_parallel_size": 2}, "model": {"path": "m"}},
     "rollout.tensor_parallel_size > 1 with rollout.engine vllm"),
    ({"rollout": {"engine": "vllm"}, "model": {"path": "m"}, "trainer": {"pack_sequences": False}},
     "trainer.pack_sequences false with rollout.engine vllm"),
    ({"rollout": {"engine": "vllm"}, "model": {"path": "m"}, "lora": {"rank": 8}}, "lora with rollout.engine vllm"),
    ({"rollout": {"top_p": 0.9}}, "rollout.top_p/top_k filters"),
    ({"rollout": {"top_k": 20}}, "rollout.top_p/top_k filters"),
    ({"trainer": {"kernel_impl": "naive"}}, "trainer.kernel_impl naive"),
    ({"trainer": {"sequence_parallel": 2}}, "trainer.sequence_parallel > 1"),
    ({"algorithm": {"old_logprobs": "rollout"}, "rollout": {"streaming": True}}, "rollout.streaming"),
    ({"algorithm": {"old_logprobs": "rollout"}, "rollout": {"placement": "split", "rollout_ranks": 1}},
     "split placement at rollout.max_lag > 0"),
])
def test_what_batch_invariance_cannot_cover_is_refused_in_one_line(changes, named):
    from flashdapo.config import merge, toy

    with pytest.raises(ConfigError) as err:
        merge(toy(), {**changes, "trainer": {**changes.get("trainer", {}), "batch_invariant": True}})
    assert f"trainer.batch_invariant: expected false with {named}" in str(err.value)
    assert "\n" not in str(err.value)
    merge(toy(), changes)  # each is fine without the flag


def test_the_vllm_engine_is_accepted_and_refused_off_cuda_at_build_in_one_line():
    """The configuration takes rollout.engine vllm with the flag; the matching forward's kernels are vLLM's
    CUDA ones, so a CPU build stops in one line (the GPU path: test_exact_on_policy_vllm.py)."""
    from flashdapo.config import merge, toy

    merge(toy(), {"rollout": {"engine": "vllm"}, "model": {"path": "m"}, "trainer": {"batch_invariant": True}})
    policy = _policy(torch.float32, invariant=False)
    with pytest.raises(ConfigError, match="needs CUDA") as err:
        make_batch_invariant(policy, torch.float32, "cpu", engine="vllm")
    assert "\n" not in str(err.value)

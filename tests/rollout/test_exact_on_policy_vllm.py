"""trainer.batch_invariant with the co-located vLLM engine, on a GPU: the three checks that settle it.

Written for a lent GPU with vLLM installed and **not yet run** (the GPU image bench/gpu_check.py runs on has no
vLLM: there these skip with the reason). Each compares bits (`torch.equal`), on the toy Qwen2 export in bf16:

1. **The trainer is batch-invariant**: a response's log-probs scored alone equal those scored packed among
   the others (models/vllm_matching.py with vLLM's kernels).
2. **Trainer prefill = engine**: the engine's sampled log-probs (vLLM's batch-invariant forward, the sampled
   token's log-prob by flashdapo's kernel, rollout/vllm_invariant.py) equal the trainer's of the same tokens.
3. **Engine decode = engine prefill**: the hidden row vLLM sampled token t+1 from in a decode step equals the
   one it computes prefilling the prompt and the first t tokens.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket

import pytest
import torch
import torch.distributed as dist

from flashdapo.config import RolloutConfig
from flashdapo.distributed.mesh import DistEnv
from flashdapo.models.invariant import make_batch_invariant
from flashdapo.models.policy import PolicyModel
from flashdapo.rollout.base import SamplingParams
from flashdapo.rollout.vllm_invariant import install_kernel_logprobs, kernel_logprobs
from tests.vllm.toy import KV_GIB, toy_export

pytestmark = [
    pytest.mark.cuda, pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the gpu extra)"),
]
CUDA = torch.device("cuda")
PROMPTS = [[5 + i, 9 + 2 * i, 14 + i, 20 + i][: 2 + i % 3] for i in range(6)]
SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=11)
ROWS: list[torch.Tensor] = []
"""The hidden rows the engine sampled from, step by step (recording_logprobs)."""


def recording_logprobs(hidden, weight, tokens, temperature):
    """The kernel's log-probs (vllm_invariant.kernel_logprobs), keeping the hidden rows for check 3."""
    ROWS.append(hidden.detach().clone())
    return kernel_logprobs(hidden, weight, tokens, temperature)


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from flashdapo.rollout.vllm_engine import VLLMEngine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    path = toy_export(tmp_path_factory.mktemp("exact_vllm") / "toy")
    engine = VLLMEngine(RolloutConfig(engine="vllm", kv_cache_gib=KV_GIB, gpu_memory_utilization=0.3), str(path),
                        rank=0, world_size=1, dtype="bfloat16", max_model_len=64, dummy_weights=False,
                        batch_invariant=True)
    engine.llm.collective_rpc(functools.partial(install_kernel_logprobs, dtype=torch.bfloat16,
                                                logprob_fn=recording_logprobs))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(CUDA).eval()
    policy = PolicyModel(hf, "sdpa", "auto", SAMPLING.temperature)
    make_batch_invariant(policy, torch.bfloat16, CUDA, engine="vllm")
    policy.set_layout(True, DistEnv(rank=0, local_rank=0, world_size=1, device=CUDA, mesh=None))
    yield engine, policy
    engine.shutdown()


def _scored(policy, prompts, responses) -> list[torch.Tensor]:
    batch = policy.token_batch([torch.tensor(p) for p in prompts], list(responses), CUDA)
    with torch.no_grad():
        logp, _ = policy(batch)
    return list(torch.split(logp.cpu(), batch.token_counts))


def test_1_the_trainer_is_batch_invariant(sides):
    _, policy = sides
    responses = [torch.randint(4, 60, (n,)) for n in (7, 13, 4, 9)]
    prompts = PROMPTS[: len(responses)]
    packed = _scored(policy, prompts, responses)
    for i in range(len(responses)):
        assert torch.equal(_scored(policy, [prompts[i]], [responses[i]])[0], packed[i]), i


def test_2_the_engines_sampled_log_probs_are_the_trainers(sides):
    engine, policy = sides
    rollouts = engine.generate(PROMPTS, SAMPLING)
    prompts = [p for p in PROMPTS for _ in range(SAMPLING.n)]
    scored = _scored(policy, prompts, rollouts.response_ids)
    for i, (got, expected) in enumerate(zip(scored, rollouts.logprobs, strict=True)):
        assert torch.equal(got, expected.cpu()), (i, (got - expected.cpu()).abs().max().item())


def test_3_engine_decode_rows_equal_engine_prefill_rows(sides):
    engine, _ = sides
    ROWS.clear()
    one = SamplingParams(n=1, temperature=1.0, max_new_tokens=8, seed=3)
    rollouts = engine.generate(PROMPTS[:1], one)
    decoded = [row[0] for row in ROWS]  # one request: one row a step, the first from the prompt's prefill
    response = rollouts.response_ids[0].tolist()
    for t in range(1, len(response)):
        ROWS.clear()
        engine.llm.reset_prefix_cache()  # a prefill of every position, none read from the decode's cache
        engine.generate([PROMPTS[0] + response[:t]], SamplingParams(n=1, temperature=1.0, max_new_tokens=1,
                                                                     seed=5))
        assert torch.equal(ROWS[0][0], decoded[t]), t

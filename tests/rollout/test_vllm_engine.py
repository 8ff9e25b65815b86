"""VLLMEngine orchestration against a recording double of the `vllm.LLM` surface (vLLM 0.33.0,
tests/helpers/vllm_double.py).

The double mirrors what the engine relies on: LLM(**kwargs), generate, sleep, wake_up, reset_prefix_cache,
apply_model, collective_rpc; child seeds seed + k for n > 1; FlatLogprobs / dict log-probs; finish
reasons; and Qwen2's loader (HF names in, q/k/v and gate/up stacked, tied lm_head an alias). Also what
vLLM 0.33.0 does to the process and to its state, as read in its source: the external_launcher executor
reads RANK and LOCAL_RANK, the worker re-seeds the global RNGs and sets torch threads to 1 (unless
OMP_NUM_THREADS is set), a sleep is skipped only when the weights already sleep, a sleep of level >= 1
clears the prefix cache, and a prefix cache filled under older weights would be reused by generate.
Its signatures are compared with the real package's when `vllm` imports. The last test runs real vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import os
import random
import socket
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashdapo.config import ConfigError, RolloutConfig
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.rollout import vllm_process
from flashdapo.rollout.base import SamplingParams
from flashdapo.rollout.vllm_engine import (
    VLLM_VERSION_READ,
    VLLMEngine,
    to_rollouts,
    tp_layout,
    vllm_target,
)
from flashdapo.rollout.vllm_process import library_versions
from flashdapo.seeds import derive_seed
from tests.helpers.vllm_double import (
    EOS,
    FAKE_VLLM,
    FakeLLM,
    FakePlatform,
    FakeSamplingParams,
    fake_vllm,
    make_engine,
    names,
    push,
    tiny_qwen2,
    vllm_qwen2_param_names,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# Every test runs as a torchrun rank 0 whose thread count is restored (tests/rollout/conftest.py).
pytestmark = pytest.mark.usefixtures("torchrun_env")


def test_llm_built_with_the_colocated_contract():
    kw = make_engine(gpu_memory_utilization=0.45, max_num_batched_tokens=4096).llm.init_kwargs
    assert kw["model"] == "/ckpt/qwen" and kw["distributed_executor_backend"] == "external_launcher"
    assert kw["enable_sleep_mode"] is True and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["load_format"] == "dummy" and kw["tensor_parallel_size"] == 1 and kw["max_model_len"] == 64
    assert kw["gpu_memory_utilization"] == 0.45 and kw["max_num_batched_tokens"] == 4096
    seeds = [make_engine(rank=r, world_size=4, tp_gather=lambda o: [o, o], tensor_parallel_size=2)
             .llm.init_kwargs["seed"] for r in range(4)]
    assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and seeds[0] != seeds[2] and 0 <= min(seeds) < 2**31


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("helper", [True, False])
def test_per_step_call_order(level, helper):
    engine = make_engine(sleep_level=level)
    prompts, sampling = [[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4, seed=1)
    for _ in range(2):
        if helper:
            push(engine)
        else:  # the same, call by call
            engine.wake_weights()
            engine.update_weights(iter_full_state_dict(tiny_qwen2(False)))
        engine.generate(prompts, sampling)
        engine.sleep()
    # No reset_prefix_cache: the first push precedes any generate, and sleep clears the cache.
    assert names(engine.llm.calls) == [
        "reload_weights", "generate", ("sleep", level),
        ("wake_up", ["weights"]), "reload_weights", ("wake_up", ["kv_cache"]), "generate", ("sleep", level)]
    assert engine.last_weight_sync_s >= 0


def test_a_version_left_awake_is_not_pushed_again():
    engine = make_engine()
    hf = tiny_qwen2(False)

    def weights(dtype):
        return iter_full_state_dict(hf, dtype=dtype)

    prompts, sampling = [[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4, seed=1)
    engine.wake(weights, version=3)
    engine.generate(prompts, sampling)
    engine.sleep(keep_awake=True)  # validation, then a training step on the same weights
    engine.wake(weights, version=3)
    engine.generate(prompts, sampling)
    engine.sleep()
    engine.wake(weights, version=3)  # asleep since: pushed again
    engine.sleep(keep_awake=True)
    engine.wake(weights, version=4)  # awake, but a new version: pushed
    assert names(engine.llm.calls) == [
        "reload_weights", "generate", "generate", ("sleep", 2), ("wake_up", ["weights"]), "reload_weights",
        ("wake_up", ["kv_cache"]), "reload_weights"]


def test_push_after_generate_without_sleep_resets_the_prefix_cache():
    engine = make_engine()
    prompts, sampling = [[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4, seed=1)
    push(engine)
    engine.generate(prompts, sampling)
    push(engine)  # no sleep in between: the cache holds KV of the first weights
    engine.generate(prompts, sampling)  # the double raises if that KV were reused
    assert names(engine.llm.calls) == ["reload_weights", "generate", "reload_weights", "reset_prefix_cache", "generate"]


def test_sleep_offloads_weights_woken_for_a_push_without_generate():
    engine = make_engine()
    push(engine)
    engine.generate([[1]], SamplingParams(max_new_tokens=2))
    engine.sleep()
    engine.wake_weights()
    engine.update_weights(iter_full_state_dict(tiny_qwen2(False)))  # weights awake, KV cache asleep
    engine.sleep()
    assert names(engine.llm.calls)[-2:] == ["reload_weights", ("sleep", 2)]
    assert engine.llm.sleeping == {"weights", "kv_cache"}
    engine.sleep()  # nothing awake: no call
    assert names(engine.llm.calls)[-1] == ("sleep", 2)
    assert len([c for c in engine.llm.calls if c[0] == "sleep"]) == 2


def test_sleep_level_2_is_the_default():
    assert RolloutConfig().sleep_level == 2
    engine = make_engine()
    push(engine)
    engine.sleep()
    assert names(engine.llm.calls)[-1] == ("sleep", 2)


def test_lm_head_in_fp32_and_overrides_merged():
    assert make_engine().llm.init_kwargs["hf_overrides"] == {"head_dtype": "float32"}
    engine = VLLMEngine(RolloutConfig(engine="vllm"), "/ckpt", rank=0, world_size=1, vllm_module=FAKE_VLLM,
                        hf_overrides={"rope_theta": 1e6})
    assert engine.llm.init_kwargs["hf_overrides"] == {"head_dtype": "float32", "rope_theta": 1e6}


def test_batch_invariant_engine_starts_in_vllms_mode_and_takes_the_sampled_log_probs_from_the_kernel(monkeypatch):
    """trainer.batch_invariant (rollout/vllm_invariant.py) on the double's CUDA platform: VLLM_BATCH_INVARIANT=1
    before the start, eager with every custom op, flash attention, no fp32 head; the hook installed on the worker
    overwrites the sampled token's log-prob with the kernel's on the rows of the last compute_logits."""
    from flashdapo.kernels import token_logprobs
    from flashdapo.rollout.vllm_invariant import install_kernel_logprobs

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")  # recorded: the engine's "1" does not outlive this test
    installed = []

    class WorkerLLM(FakeLLM):
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            if callable(method):
                installed.append(method)
                return [None]
            return super().collective_rpc(method, timeout, args, kwargs)

    engine = VLLMEngine(RolloutConfig(engine="vllm"), "/ckpt", rank=0, world_size=1, batch_invariant=True,
                        vllm_module=fake_vllm(llm=WorkerLLM))
    kw = engine.llm.init_kwargs
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1" and "head_dtype" not in kw["hf_overrides"]
    assert (kw["enforce_eager"], kw["compilation_config"], kw["attention_backend"]) == (
        True, {"custom_ops": ["all"]}, "FLASH_ATTN")
    assert len(installed) == 1

    torch.manual_seed(0)
    head = SimpleNamespace(weight=torch.randn(80, 16), org_vocab_size=70)  # vLLM pads the head's rows
    model = SimpleNamespace(lm_head=head, compute_logits=lambda h: h @ head.weight[:70].t())
    sampled = torch.tensor([[3], [69], [12]])

    def sampler_forward(logits, metadata):
        lp = SimpleNamespace(logprobs=torch.full((3, 2), 7.0))
        return SimpleNamespace(sampled_token_ids=sampled, logprobs_tensors=lp)

    runner = SimpleNamespace(model=model, sampler=SimpleNamespace(forward=sampler_forward))
    install_kernel_logprobs(SimpleNamespace(model_runner=runner))
    hidden = torch.randn(3, 16)
    out = runner.sampler.forward(runner.model.compute_logits(hidden), SimpleNamespace(temperature=torch.full((3,), 0.8)))
    expected = token_logprobs(hidden, head.weight[:70], sampled[:, 0], temperature=0.8, invariant=True)
    assert torch.equal(out.logprobs_tensors.logprobs[:, 0], expected)
    assert torch.equal(out.logprobs_tensors.logprobs[:, 1], torch.full((3,), 7.0))  # only the sampled column
    with pytest.raises(RuntimeError, match="vLLM sampled 3 rows but the last compute_logits saw None"):
        runner.sampler.forward(None, SimpleNamespace(temperature=torch.ones(3)))


def test_launcher_env_set_without_torchrun(monkeypatch):
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("LOCAL_RANK")
    engine = VLLMEngine(RolloutConfig(engine="vllm"), "/ckpt", rank=0, world_size=1, vllm_module=FAKE_VLLM)
    assert engine.llm.launcher == (0, 0)
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun says another device than the trainer uses
    with pytest.raises(RuntimeError, match="LOCAL_RANK=1 but the trainer runs as local_rank 0"):
        VLLMEngine(RolloutConfig(engine="vllm"), "/ckpt", rank=0, world_size=1, local_rank=0,
                   vllm_module=FAKE_VLLM)


@pytest.mark.parametrize("omp", [None, "3"])
def test_trainer_rngs_and_threads_survive_the_engine(monkeypatch, omp):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    torch.set_num_threads(2)
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    engine = make_engine()
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert torch.get_num_threads() == 2
    push(engine)
    engine.generate([[1]], SamplingParams(max_new_tokens=2))
    assert engine.llm.generate_threads == (1 if omp is None else 2)  # what vLLM set for its own loop
    assert torch.get_num_threads() == 2


def test_tested_vllm_version_pinned_and_logged():
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f'"vllm=={VLLM_VERSION_READ}"' in pyproject
    line = library_versions()
    assert line.startswith(f"torch {torch.__version__}, triton ") and ", vllm " in line
    with pytest.warns(UserWarning, match="vLLM 0.35.0 is installed; the engine was checked against vLLM 0.32.0, "
                                         "0.33.0, 0.34.0"):  # refused without the override: test_vllm_versions.py
        make_engine(vllm_module=fake_vllm(version="0.35.0"), vllm_untested_ok=True)


def test_generate_refuses_dummy_or_discarded_weights():
    engine = make_engine(sleep_level=2)
    with pytest.raises(RuntimeError, match="dummy, discarded"):
        engine.generate([[1]], SamplingParams())
    push(engine)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[1]], SamplingParams())
    engine.wake_weights()  # level 2: the woken weights are garbage until pushed
    with pytest.raises(RuntimeError, match="dummy, discarded"):
        engine.generate([[1]], SamplingParams())
    level1 = make_engine(sleep_level=1)
    push(level1)
    level1.sleep()
    level1.wake_weights()  # level 1: weights come back from CPU; the KV cache wakes inside generate
    level1.generate([[1]], SamplingParams(max_new_tokens=2))
    assert names(level1.llm.calls)[-2:] == [("wake_up", ["kv_cache"]), "generate"]


@pytest.mark.parametrize("tied", [True, False])
def test_every_qwen2_parameter_maps_and_loads(tied):
    hf = tiny_qwen2(tied)
    llm_class = type("Qwen2LLM", (FakeLLM,), {"config": hf.config})
    engine = make_engine(vllm_module=fake_vllm(llm_class))
    push(engine, tied)
    loads = engine.llm.model.loads
    hf_names = [n for n in hf.state_dict() if not (tied and n == "lm_head.weight")]
    assert sorted(name for name, *_ in loads) == sorted(hf_names)
    assert {target for _, target, _, _ in loads} == set(vllm_qwen2_param_names(hf.config))
    for name, target, shard, tensor in loads:
        assert vllm_target(name) == (target, shard)
        assert tensor.dtype == torch.bfloat16  # cast to the engine's dtype on the way
        torch.testing.assert_close(tensor, hf.state_dict()[name].to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("drop, culprit", [("model.layers.0.self_attn.v_proj.weight", "qkv_proj.weight"),
                                           ("model.norm.weight", "model.norm.weight")])
def test_incomplete_push_raises(drop, culprit):
    engine = make_engine()
    stream = ((n, t) for n, t in iter_full_state_dict(tiny_qwen2(False)) if n != drop)
    with pytest.raises(RuntimeError, match=culprit):
        engine.update_weights(stream)
    with pytest.raises(RuntimeError, match="partly pushed"):
        engine.generate([[1]], SamplingParams())


def test_tp_group_submits_identical_inputs_and_keeps_its_slice():
    mine = {2: [[10, 11], [12]], 3: [[13, 14, 15]]}  # ranks 2, 3 form TP group 1 of a world of 4

    def gather_for(rank):
        def gather(obj):
            assert obj == mine[rank]
            return [mine[2], mine[3]]
        return gather

    sampling = SamplingParams(n=3, max_new_tokens=5, seed=9)
    engines = {r: make_engine(rank=r, world_size=4, tp_gather=gather_for(r), tensor_parallel_size=2)
               for r in (2, 3)}
    results = {}
    for rank, engine in engines.items():
        push(engine)
        results[rank] = engine.generate(mine[rank], sampling)
    submitted = [e.llm.calls[-1] for e in engines.values()]
    assert submitted[0][1] == submitted[1][1] == mine[2] + mine[3]
    assert [p.seed for p in submitted[0][2]] == [p.seed for p in submitted[1][2]]
    for rank, rollouts in results.items():
        assert len(rollouts) == 3 * len(mine[rank])
        assert [p.tolist() for p in rollouts.prompt_ids] == [p for p in mine[rank] for _ in range(3)]
        assert rollouts.group_ids.tolist() == [g for g in range(len(mine[rank])) for _ in range(3)]
    assert results[2].response_ids[3].tolist() != results[3].response_ids[0].tolist()


def test_seed_derivation():
    assert derive_seed(1, 2, 3) == derive_seed(1, 2, 3) and 0 <= derive_seed(1, 2, 3) < 2**62
    assert len({derive_seed(s, g, i) for s in range(5) for g in range(5) for i in range(50)}) == 1250
    assert derive_seed(-1) >= 0
    sampling = SamplingParams(n=4, max_new_tokens=8, seed=3)
    a, b, c = (make_engine(rank=r, world_size=2) for r in (0, 0, 1))
    for e in (a, b, c):
        push(e)
    prompts = [[4, 5], [4, 5]]
    ra, rb, rc = (e.generate(prompts, sampling) for e in (a, b, c))
    assert [r.tolist() for r in ra.response_ids] == [r.tolist() for r in rb.response_ids]  # runs repeat
    seeds = [p.seed for p in a.llm.calls[-1][2]]
    assert seeds == [derive_seed(3, 0, 0), derive_seed(3, 0, 1)]
    assert seeds != [p.seed for p in c.llm.calls[-1][2]]  # another DP group draws other seeds
    responses = [r.tolist() for r in ra.response_ids]
    assert len({tuple(r) for r in responses}) > 1  # same prompt, different samples
    rd = a.generate(prompts, dataclasses.replace(sampling, seed=4))
    assert [r.tolist() for r in rd.response_ids] != responses


@pytest.mark.parametrize("flat, extra", [(True, False), (True, True), (False, True)])
def test_outputs_convert_to_rollouts(flat, extra):
    llm = FakeLLM("m")
    llm.flat, llm.extra_entries = flat, extra
    params = [FakeSamplingParams(n=3, max_tokens=4, seed=s) for s in (11, 12, 13)]
    outputs = llm.generate([{"prompt_token_ids": [1]}] * 3, params)
    rollouts = to_rollouts(outputs, [[1], [2, 3], [4]], n=3)
    assert rollouts.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert rollouts.prompt_ids[3] is rollouts.prompt_ids[5] and rollouts.prompt_ids[3].tolist() == [2, 3]
    completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
    assert {c.finish_reason for c in completions} == {"stop", "length"}  # both cases covered
    for i, c in enumerate(completions):
        assert rollouts.response_ids[i].tolist() == c.token_ids
        assert bool(rollouts.truncated[i]) == (c.finish_reason == "length")
        assert (rollouts.response_ids[i][-1] == EOS) == (c.finish_reason == "stop")  # EOS kept
        assert rollouts.logprobs[i].dtype == torch.float32
        torch.testing.assert_close(rollouts.logprobs[i], torch.tensor(c.expected))


def test_bad_outputs_raise():
    llm = FakeLLM("m")
    outputs = llm.generate([{"prompt_token_ids": [1]}], [FakeSamplingParams(n=2, max_tokens=3, seed=1)])
    with pytest.raises(RuntimeError, match="expected n=3"):
        to_rollouts(outputs, [[1]], n=3)
    llm.finish_override = "abort"
    outputs = llm.generate([{"prompt_token_ids": [1]}], [FakeSamplingParams(n=2, max_tokens=3, seed=1)])
    with pytest.raises(RuntimeError, match="'abort'"):
        to_rollouts(outputs, [[1]], n=2)


def test_wake_checks_the_memory_budget_first(monkeypatch):
    """A simulated GPU: vLLM's sleep frees 30 GiB that waking maps again; the trainer then grows."""
    import flashdapo.rollout.vllm_engine as module

    gib, gpu = 2**30, {"free": 10 * 2**30, "allocated": 40 * 2**30}
    monkeypatch.setattr(module, "gpu_memory", lambda: (gpu["free"], 80 * gib, gpu["allocated"]))

    class MeteredLLM(FakeLLM):
        def sleep(self, level=1, mode="abort"):
            if "weights" not in self.sleeping:
                gpu["free"] += 30 * gib
            super().sleep(level, mode)

        def wake_up(self, tags=None):
            gpu["free"] -= {"weights": 14, "kv_cache": 16}[tags[0]] * gib
            return super().wake_up(tags)

    engine = make_engine(vllm_module=fake_vllm(MeteredLLM))
    push(engine)
    engine.generate([[1]], SamplingParams(max_new_tokens=2))
    engine.sleep()
    push(engine)  # 40 GiB free: room for the 30 GiB
    engine.sleep()
    gpu["free"] -= 12 * gib  # Adam moments appear
    gpu["allocated"] += 12 * gib
    with pytest.raises(RuntimeError, match=r"waking vLLM needs 30.00 GiB of GPU memory \(its weights and KV cache, "
                       r"sized at start by rollout.gpu_memory_utilization=0.5 of 80.00 GiB\) but 28.00 GiB are "
                       r"free, with 52.00 GiB held by the trainer: lower rollout.gpu_memory_utilization or set "
                       r"trainer.fsdp_cpu_offload=true"):
        push(engine)
    assert names(engine.llm.calls)[-1] == ("sleep", 2)  # nothing woken


@pytest.mark.parametrize("field", ["temperature", "val_temperature"])
def test_config_takes_only_temperatures_vllm_samples_at(field):
    for ok in (0.01, 1.0, 2.0):
        RolloutConfig(engine="vllm", **{field: ok})
    for bad in (0.005, 2.5):
        with pytest.raises(ConfigError, match=rf"rollout.{field}: expected a value in \[0.01, 2\] with engine='vllm'"):
            RolloutConfig(engine="vllm", **{field: bad})
        RolloutConfig(engine="torch", **{field: bad})  # the torch engine samples at any temperature


def test_tp_layout_and_missing_vllm(monkeypatch):
    assert tp_layout(5, 8, 4) == (1, 1, [4, 5, 6, 7])
    with pytest.raises(ValueError, match="must divide the world size"):
        tp_layout(0, 6, 4)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"\[gpu\]"):
        VLLMEngine(RolloutConfig(engine="vllm"), "/ckpt", rank=0, world_size=1)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_double_matches_the_installed_vllm():
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for method in ("generate", "sleep", "wake_up", "reset_prefix_cache", "apply_model", "collective_rpc"):
        assert shape(getattr(FakeLLM, method)) == shape(getattr(vllm.LLM, method)), method
    accepted = set(inspect.signature(vllm.LLM.__init__).parameters)
    accepted |= {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(make_engine().llm.init_kwargs) <= accepted
    from flashdapo.rollout.vllm_invariant import ENGINE_KWARGS

    assert set(ENGINE_KWARGS) <= accepted  # trainer.batch_invariant's engine
    fields = {f.name: f.default for f in dataclasses.fields(FakeSamplingParams)}
    vllm.SamplingParams(**{**fields, "logprobs": 0, "seed": derive_seed(1, 2, 3), "top_k": 0})
    from vllm.v1.executor.abstract import SLEEP_TAGS
    assert SLEEP_TAGS == {"weights", "kv_cache"}
    from vllm.v1.worker.gpu_model_runner import (
        GPUModelRunner,  # what collective_rpc("reload_weights") reaches
    )
    assert {"weights_iterator", "is_checkpoint_format"} <= set(inspect.signature(GPUModelRunner.reload_weights).parameters)
    from vllm.platforms import current_platform
    assert current_platform.is_sleep_mode_available() == FakePlatform(current_platform.device_name).is_sleep_mode_available()
    from vllm.exceptions import VLLMValidationError
    with pytest.raises(VLLMValidationError, match="temperature"):  # what the config refuses for engine='vllm'
        vllm.SamplingParams(temperature=2.5)
    assert vllm.SamplingParams(temperature=0.005).temperature == 0.01


@pytest.mark.vllm
@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason="needs vllm and a CUDA GPU")
def test_real_vllm_end_to_end(tmp_path, monkeypatch):
    """One rank: push weights, generate, compare log-probs with HF, sleep level 2, re-push, repeat."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    hf = Qwen2ForCausalLM(config).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    hf = hf.cuda().eval()
    engine = VLLMEngine(RolloutConfig(engine="vllm", gpu_memory_utilization=0.3, max_num_batched_tokens=2048,
                                      sleep_level=2), str(tmp_path), rank=0, world_size=1, max_model_len=256,
                        skip_tokenizer_init=True, enforce_eager=True)
    prompts, sampling = [[1, 2, 3, 4], [5, 6, 7]], SamplingParams(n=4, max_new_tokens=16, seed=7)
    engine.wake(lambda dtype: iter_full_state_dict(hf, dtype=dtype))
    first = engine.generate(prompts, sampling)
    assert len(first) == 8
    assert [len(r) for r in first.response_ids] == [len(lp) for lp in first.logprobs]
    with torch.no_grad():
        trainer = []
        for p, r in zip(first.prompt_ids, first.response_ids, strict=True):
            ids = torch.cat([p, r]).cuda()[None]
            logp = torch.log_softmax(hf(ids).logits[0, len(p) - 1: -1].float(), -1)
            trainer.append(logp.gather(-1, r.cuda()[:, None])[:, 0].cpu())
    diff = (torch.cat(first.logprobs) - torch.cat(trainer)).abs()
    assert diff.mean() < 0.05, (diff.mean(), diff.max())
    engine.sleep()
    engine.wake(lambda dtype: iter_full_state_dict(hf, dtype=dtype))
    again = engine.generate(prompts, sampling)
    assert [r.tolist() for r in again.response_ids] == [r.tolist() for r in first.response_ids]
    engine.sleep()
    with torch.no_grad():
        hf.lm_head.weight.zero_()  # a pushed (not reloaded) head gives uniform log-probs
    engine.wake(lambda dtype: iter_full_state_dict(hf, dtype=dtype))
    flat = torch.cat(engine.generate(prompts, sampling).logprobs)
    torch.testing.assert_close(flat, torch.full_like(flat, -math.log(512)), atol=1e-3, rtol=0)


def test_cpu_platform_has_no_sleep_mode_and_an_explicit_kv_budget(monkeypatch):
    """vLLM's CPU platform refuses enable_sleep_mode and ignores sleep; the KV cache gets a size of its own."""
    cpu = fake_vllm(device="cpu")
    engine = make_engine(vllm_module=cpu, kv_cache_gib=0.5)
    kw = engine.llm.init_kwargs
    assert kw["enable_sleep_mode"] is False and kw["kv_cache_memory_bytes"] == 2**29 and kw["enforce_eager"] is True
    assert "no sleep mode" in engine.started_line and "KV cache 0.5 GiB per rank" in engine.started_line
    prompts, sampling = [[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4, seed=1)
    for _ in range(2):
        push(engine)
        engine.generate(prompts, sampling)  # the double raises if KV of the first weights were reused
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.sleep()
        assert len(caught) == (1 if _ == 0 else 0)  # said once
    assert names(engine.llm.calls) == ["reload_weights", "generate", "reload_weights", "reset_prefix_cache",
                                       "generate"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's count: the node's 4 engine ranks share its memory
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(vllm_process, "available_host_memory", lambda: 16 * 2**30)
    shared = make_engine(vllm_module=cpu, world_size=4, gpu_memory_utilization=0.5)
    assert shared.llm.init_kwargs["kv_cache_memory_bytes"] == 2 * 2**30
    assert "kv_cache_memory_bytes" not in make_engine().llm.init_kwargs  # CUDA: gpu_memory_utilization decides


def test_thread_count_restored_under_vllms_cpu_stub(monkeypatch):
    """vLLM's CPU worker replaces torch.set_num_threads with a stub that only warns (cpu_worker.py)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    real = torch.set_num_threads

    class StubbingLLM(FakeLLM):
        def __init__(self, model, **kwargs):
            super().__init__(model, **kwargs)  # sets 1 thread, as vLLM's worker does
            torch.set_num_threads = lambda _n: None

    monkeypatch.setattr(torch, "set_num_threads", real)  # put back after the test
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LD_PRELOAD", "/keep/me.so")
    real(2)
    engine = make_engine(vllm_module=fake_vllm(StubbingLLM, device="cpu"), kv_cache_gib=0.01)
    assert torch.get_num_threads() == 2 and torch.set_num_threads is not real
    assert "stubbed torch.set_num_threads; the trainer's 2 thread(s) set with torch's own setter (now 2)" in \
        engine.started_line
    push(engine)
    engine.generate([[1]], SamplingParams(max_new_tokens=2))
    assert engine.llm.generate_threads == 1 and torch.get_num_threads() == 2
    assert os.environ["LD_PRELOAD"] == "/keep/me.so" and os.environ["LOCAL_WORLD_SIZE"] == "1"


def test_engine_shuts_down_before_the_process_group_is_destroyed():
    import torch.distributed as dist

    from flashdapo.distributed.mesh import before_destroy, shutdown

    seen = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    before_destroy(lambda: seen.append(dist.is_initialized()))
    shutdown()
    assert seen == [True] and not dist.is_initialized()

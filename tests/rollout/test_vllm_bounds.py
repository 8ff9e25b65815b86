"""vLLM's bounds before it starts (KV cache against the model and the memory, the CPU platform's token budget)
and its failures as one line, against the recording double of `vllm.LLM` (no vLLM needed)."""

from __future__ import annotations

import json
import re

import pytest

from flashdapo.config import ConfigError, RolloutConfig
from flashdapo.errors import user_error_line
from flashdapo.rollout import vllm_process
from flashdapo.rollout.base import SamplingParams
from flashdapo.rollout.vllm_bounds import (
    CPU_RUNTIME_BYTES,
    GIB,
    VLLMEngineError,
    check_gpu_memory,
    check_host_memory,
    check_kv_cache,
    kv_shape,
    with_flashdapo_names,
)
from flashdapo.rollout.vllm_engine import VLLMEngine
from tests.helpers.vllm_double import FakeLLM, fake_vllm, push

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 32
# Every test runs as a torchrun rank 0 whose thread count is restored (tests/rollout/conftest.py).
pytestmark = pytest.mark.usefixtures("torchrun_env")


@pytest.fixture
def model_dir(tmp_path):
    """A model directory as the checks read it: config.json (3 layers, 2 KV heads of 32) and 1 MiB of weights."""
    config = {"model_type": "qwen2", "num_hidden_layers": LAYERS, "num_attention_heads": 4,
              "num_key_value_heads": KV_HEADS, "hidden_size": 4 * HEAD_DIM, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 2**20)
    return tmp_path


def test_kv_cache_must_hold_one_sequence_of_the_maximum_length(model_dir):
    shape = kv_shape(str(model_dir), "float32", tensor_parallel=1)
    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # K and V, float32
    assert shape.bytes_per_token == per_token and kv_shape(str(model_dir), "bfloat16", 2).bytes_per_token == \
        per_token // 2 // 2  # bf16, half the KV heads per rank
    need = 3 * 128 * per_token  # 300 tokens in whole CPU blocks of 128
    config = RolloutConfig(engine="vllm", kv_cache_gib=0.000001)
    check_kv_cache(config, need, shape, 300, 128)  # exactly enough
    with pytest.raises(ConfigError) as info:
        check_kv_cache(config, need - 1, shape, 300, 128)
    message = str(info.value)
    assert message.startswith("rollout.kv_cache_gib=1e-06: holds 383 tokens of this model's KV cache") and \
        "fewer than one sequence of data.max_prompt_length + rollout.max_response_length = 300 tokens" in message


def test_kv_caches_beyond_the_hosts_memory_are_refused_naming_the_field():
    available, weights = 16 * GIB, 2 * GIB
    explicit = RolloutConfig(engine="vllm", kv_cache_gib=1000)
    with pytest.raises(ConfigError, match=r"^rollout.kv_cache_gib=1000: the node's 2 rank\(s\) would hold 2 x 1e\+03 "
                                          r"GiB of KV cache, but the host has 16 GiB available"):
        check_host_memory(explicit, 1000 * GIB, 2, available, weights)
    fits = (available - 2 * (weights + CPU_RUNTIME_BYTES)) // 2
    check_host_memory(RolloutConfig(engine="vllm", kv_cache_gib=fits / GIB), fits, 2, available, weights)
    greedy = RolloutConfig(engine="vllm", gpu_memory_utilization=0.99)
    with pytest.raises(ConfigError, match=r"^rollout.gpu_memory_utilization=0.99: on vLLM's CPU platform .* at most "
                                          r"0.62, or set rollout.kv_cache_gib"):
        check_host_memory(greedy, int(0.99 * available / 2), 2, available, weights)


def test_gpu_memory_utilization_beyond_the_free_memory_is_refused():
    total, free, held = 140 * GIB, 60 * GIB, 70 * GIB
    with pytest.raises(ConfigError, match=r"^rollout.gpu_memory_utilization=0.99: vLLM takes that fraction of the "
                                          r"GPU's 140 GiB \(139 GiB\) at start, but 60 GiB are free .* at most 0.42"):
        check_gpu_memory(RolloutConfig(engine="vllm", gpu_memory_utilization=0.99), free, total, held, 0)
    check_gpu_memory(RolloutConfig(engine="vllm", gpu_memory_utilization=0.42), free, total, held, 0)
    with pytest.raises(ConfigError, match=r"^rollout.kv_cache_gib=1000: .* at most 50 GiB fits"):
        check_gpu_memory(RolloutConfig(engine="vllm", gpu_memory_utilization=0.1, kv_cache_gib=1000), free, total,
                         held, 10 * GIB)


def _engine(model, vllm_module, capsys=None, **config):
    return VLLMEngine(RolloutConfig(engine="vllm", **config), str(model), rank=0, world_size=1, local_rank=0,
                      max_model_len=300, vllm_module=vllm_module, error_log=model / "vllm-error.rank0.log")


def test_cpu_platform_runs_without_chunked_prefill_and_a_budget_of_a_whole_sequence(model_dir, capsys,
                                                                                      monkeypatch):
    monkeypatch.setattr(vllm_process, "available_host_memory", lambda: 16 * GIB)
    engine = _engine(model_dir, fake_vllm(device="cpu"), kv_cache_gib=0.01, max_num_batched_tokens=64)
    kw = engine.llm.init_kwargs
    assert kw["enable_chunked_prefill"] is False and kw["max_num_batched_tokens"] == 300
    out = capsys.readouterr().out
    assert "flashdapo: rollout.max_num_batched_tokens raised from 64 to 300 (data.max_prompt_length + " \
           "rollout.max_response_length): vLLM's CPU platform runs with chunked prefill off" in out
    kept = _engine(model_dir, fake_vllm(device="cpu"), kv_cache_gib=0.01).llm.init_kwargs
    assert kept["max_num_batched_tokens"] == 8192 and "raised from" not in capsys.readouterr().out
    cuda = _engine(model_dir, fake_vllm(device="cuda"), max_num_batched_tokens=64).llm.init_kwargs
    assert "enable_chunked_prefill" not in cuda and cuda["max_num_batched_tokens"] == 64  # CUDA generators rewind
    with pytest.raises(ConfigError, match=r"^rollout.kv_cache_gib=1e-06: holds"):  # checked before vLLM starts
        _engine(model_dir, fake_vllm(device="cpu", llm=_NeverStarts), kv_cache_gib=0.000001)


class _NeverStarts(FakeLLM):
    def __init__(self, model, **kwargs):
        raise ValueError("To serve at least one request with the models's max seq len (300), (0.01 GiB KV cache is "
                         "needed, which is larger than the available KV cache memory (0.00 GiB). Based on the "
                         "available memory, the estimated maximum model length is 0. Try increasing "
                         "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")


class _CrashesInGenerate(FakeLLM):
    def generate(self, *args, **kwargs):
        raise RuntimeError("CPU Generator does not use offset")


def test_a_failing_start_or_generate_is_one_line_with_the_traceback_in_a_file(model_dir):
    with pytest.raises(VLLMEngineError) as info:
        _engine(model_dir, fake_vllm(device="cuda", llm=_NeverStarts))
    line = user_error_line(info.value)
    assert line.startswith("flashdapo: error: vLLM failed while starting on rank 0: ValueError: To serve at least") \
        and "Try increasing rollout.gpu_memory_utilization or decreasing data.max_prompt_length + " \
            "rollout.max_response_length when" in line and "\n" not in line, line
    engine = _engine(model_dir, fake_vllm(device="cuda", llm=_CrashesInGenerate))
    push(engine)
    with pytest.raises(VLLMEngineError) as info:
        engine.generate([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4))
    log = model_dir / "vllm-error.rank0.log"
    assert str(info.value) == ("vLLM failed while generating on rank 0: RuntimeError: CPU Generator does not use "
                               f"offset; full traceback in {log}")
    traceback = log.read_text()
    assert "Traceback (most recent call last)" in traceback and "_CrashesInGenerate" not in str(info.value)
    assert re.search(r"in generate\n\s+raise RuntimeError", traceback), traceback


def test_vllms_option_names_become_flashdapos_fields():
    assert with_flashdapo_names("Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce ...") == \
        "Decrease rollout.kv_cache_gib, VLLM_CPU_KVCACHE_SPACE, or reduce ..."
    assert with_flashdapo_names("max_num_batched_tokens (64) is smaller than max_model_len (300)") == \
        "rollout.max_num_batched_tokens (64) is smaller than data.max_prompt_length + rollout.max_response_length (300)"


@pytest.mark.parametrize(("env", "engine_ranks", "expected"), [
    ({}, 4, 4),  # no torchrun: the engine's own ranks
    ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "RANK": "1"}, 1, 1),  # split 1 + 1: the trainer rank holds none
    ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16", "RANK": "3"}, 16, 8),  # co-located: every rank of the node
    ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16", "RANK": "9"}, 8, 8),  # split 8 + 8: the second node's
    ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16", "RANK": "6"}, 12, 4),  # split 4 + 12: the first node's last 4
    ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "128", "RANK": "127"}, 32, 8),  # 128 H20s, 32 rollout ranks
])
def test_the_kv_cache_share_counts_the_nodes_engine_ranks_not_its_trainer_ranks(env, engine_ranks, expected,
                                                                                 monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert vllm_process.engine_ranks_on_node(engine_ranks) == expected


def test_a_config_error_after_the_launch_is_one_line():
    """An engine's own condition found on a rank after the launch (not a FlashdapoError) is still one line."""
    line = user_error_line(ConfigError("rollout.kv_cache_gib=1000: the node's 1 rank(s) would hold ..."))
    assert line == "flashdapo: config error: rollout.kv_cache_gib=1000: the node's 1 rank(s) would hold ..."

"""A recording double of the `vllm.LLM` surface (vLLM 0.33.0), for VLLMEngine's tests on any machine.

The double mirrors what the engine relies on: LLM(**kwargs), generate, sleep, wake_up, reset_prefix_cache,
apply_model, collective_rpc; child seeds seed + k for n > 1; FlatLogprobs / dict log-probs; finish
reasons; and Qwen2's loader (HF names in, q/k/v and gate/up stacked, tied lm_head an alias). Also what
vLLM 0.33.0 does to the process and to its state, as read in its source: the external_launcher executor
reads RANK and LOCAL_RANK, the worker re-seeds the global RNGs and sets torch threads to 1 (unless
OMP_NUM_THREADS is set), a sleep is skipped only when the weights already sleep, a sleep of level >= 1
clears the prefix cache, and a prefix cache filled under older weights would be reused by generate.
tests/rollout/test_vllm_engine.py compares its signatures with the real package's when `vllm` imports; the
`torchrun_env` fixture (tests/rollout/conftest.py) gives each test the rank-0 environment it reads.

For streaming (StreamLLM, STREAM_VLLM), a double of vLLM's step-wise `LLMEngine` as `llm.llm_engine` (vLLM
0.32.0 `v1/engine/llm_engine.py`, `output_processor.py`): add_request(request_id, prompt, params), FCFS
admission as the batch has room, one token per running request per step, DELTA outputs (new tokens and
their FlatLogprobs only), abort_request dropping requests without a last output, has_unfinished_requests;
each request samples from a generator seeded with its own seed (`script`).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import random
from collections import deque
from types import SimpleNamespace

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashdapo.config import RolloutConfig
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.rollout.vllm_engine import VLLM_VERSION_READ, VLLMEngine

EOS = 2
# Copied from vllm 0.33 model_executor/models/qwen2.py (Qwen2Model.hf_to_vllm_mapper), independently of
# the engine's own table, so the mapping is checked against vLLM's rather than against itself.
VLLM_QWEN2_STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"),
                      ".v_proj": (".qkv_proj", "v"), ".gate_proj": (".gate_up_proj", 0),
                      ".up_proj": (".gate_up_proj", 1)}


def tiny_qwen2(tied: bool) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 from seed 0 (vocabulary 40, hidden size 16), its LM head tied or its own."""
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=24,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=tied))


def vllm_qwen2_param_names(config: Qwen2Config) -> list[str]:
    """named_parameters() of vLLM 0.33's Qwen2ForCausalLM (qwen2.py: qkv bias on, o_proj bias off)."""
    per_layer = ["self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias", "self_attn.o_proj.weight",
                 "mlp.gate_up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight"]
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{s}" for i in range(config.num_hidden_layers) for s in per_layer]
    return names + ["model.norm.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])


class FakeQwen2:
    """vLLM's in-worker model: named_parameters and load_weights with vLLM's name handling."""

    def __init__(self, config: Qwen2Config):
        self.config, self.loads = config, []
        self.params = vllm_qwen2_param_names(config)

    def named_parameters(self):
        return [(name, None) for name in self.params]

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                raise ValueError("'lm_head.weight' was skipped because it is tied to the embedding")
            target, shard = name, None
            for hf_part, (vllm_part, shard_id) in VLLM_QWEN2_STACKED.items():
                if hf_part in target:
                    target, shard = target.replace(hf_part, vllm_part, 1), shard_id
            if target not in self.params:
                raise ValueError(f"There is no module or parameter named {target!r}")
            self.loads.append((name, target, shard, tensor.clone()))
            loaded.add(target)
        return loaded


@dataclasses.dataclass
class FakeSamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    logprobs: int | None = None
    seed: int | None = None
    detokenize: bool = True
    flat_logprobs: bool = False
    stop_token_ids: list | None = None  # recorded only: the scripted samples do not stop at them


@dataclasses.dataclass
class FakeFlatLogprobs:
    start_indices: list
    end_indices: list
    token_ids: list
    logprobs: list

    def __len__(self):
        return len(self.start_indices)


class FakeLLM:
    """Records every call; samples deterministically from per-request seeds (child k: seed + k)."""

    config = tiny_qwen2(tied=False).config
    flat, extra_entries, finish_override = True, False, None

    def __init__(self, model, **kwargs):
        self.init_kwargs = {"model": model, **kwargs}
        if kwargs.get("distributed_executor_backend") == "external_launcher":  # uniproc_executor.py
            self.launcher = (int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]))
        seed = kwargs.get("seed", 0)  # utils/torch_utils.py set_random_seed, from the worker
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        if "OMP_NUM_THREADS" not in os.environ:  # set_torch_threads_for_runtime
            torch.set_num_threads(1)
        self.calls, self.sleeping = [], set()
        self.model = FakeQwen2(self.config)
        self.weights_version, self.cache_version = 0, None  # weights the prefix cache's KV was computed with

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None,
                 tokenization_kwargs=None, mm_processor_kwargs=None):
        self.calls.append(("generate", [p["prompt_token_ids"] for p in prompts], list(sampling_params)))
        self.generate_threads = torch.get_num_threads()
        if self.sleeping:
            raise RuntimeError(f"generate while {self.sleeping} asleep: vLLM's scheduler would stay paused")
        if self.cache_version not in (None, self.weights_version):
            raise RuntimeError("generate would reuse prefix-cache KV computed with older weights")
        self.cache_version = self.weights_version
        return [SimpleNamespace(outputs=[self._sample(sp, k) for k in reversed(range(sp.n))])
                for sp in sampling_params]

    def _sample(self, sp, k):
        g = torch.Generator().manual_seed(sp.seed + k)
        length = int(torch.randint(1, sp.max_tokens + 1, (1,), generator=g))
        tokens = torch.randint(3, 40, (length,), generator=g).tolist()
        reason = "length" if length == sp.max_tokens else "stop"
        if reason == "stop":
            tokens[-1] = EOS
        values = (-torch.rand(length, generator=g) * 5).tolist()
        if self.flat:
            ids, lps, starts, ends = [], [], [], []
            for tok, lp in zip(tokens, values, strict=True):
                starts.append(len(ids))
                ids.append(tok), lps.append(lp)
                if self.extra_entries:
                    ids.append(tok + 100), lps.append(-0.01)
                ends.append(len(ids))
            logprobs = FakeFlatLogprobs(starts, ends, ids, lps)
        else:
            logprobs = [{t: SimpleNamespace(logprob=v), t + 100: SimpleNamespace(logprob=-0.01)}
                        for t, v in zip(tokens, values, strict=True)]
        return SimpleNamespace(index=k, token_ids=tokens, logprobs=logprobs, expected=values,
                               finish_reason=self.finish_override or reason)

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level))
        self.cache_version = None  # core.py: pause_scheduler(clear_cache=True) resets the prefix cache
        if "weights" in self.sleeping:  # executor/abstract.py: "Executor is already sleeping."
            return
        self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        assert all(t in self.sleeping for t in tags), f"waking {tags} while {self.sleeping} sleep"
        self.sleeping -= set(tags)
        return not self.sleeping

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache",))
        self.cache_version = None
        return True

    def apply_model(self, func):
        assert "weights" not in self.sleeping, "touching a sleeping (offloaded/discarded) model"
        return [func(self.model)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """Only the worker's `reload_weights` (gpu_worker.py), with an iterator: without one it reloads the
        checkpoint from disk (reload/inplace.py)."""
        self.calls.append((method,))
        assert method == "reload_weights" and kwargs["weights_iterator"] is not None, (method, kwargs)
        assert kwargs["is_checkpoint_format"] is True
        assert "weights" not in self.sleeping, "loading weights into a sleeping (offloaded/discarded) model"
        self.weights_version += 1
        for name, tensor in kwargs["weights_iterator"]:  # the Qwen2 loader, one tensor at a time
            self.model.load_weights([(name, tensor)])
        return [None]


@dataclasses.dataclass
class FakePlatform:
    """vllm.platforms.current_platform: sleep mode on CUDA/ROCm/XPU only (platforms/interface.py)."""

    device_name: str = "cuda"

    def is_cpu(self):
        return self.device_name == "cpu"

    def is_sleep_mode_available(self):
        return self.device_name == "cuda"


def fake_vllm(llm=None, version=VLLM_VERSION_READ, device="cuda"):
    """A stand-in for the `vllm` module: LLM (FakeLLM unless `llm`), SamplingParams, the version, the platform."""
    return SimpleNamespace(LLM=llm or FakeLLM, SamplingParams=FakeSamplingParams, __version__=version,
                           __name__="fake_vllm", platforms=SimpleNamespace(current_platform=FakePlatform(device)))


FAKE_VLLM = fake_vllm()


def make_engine(rank=0, world_size=1, tp_gather=None, vllm_module=FAKE_VLLM, **config):
    """A VLLMEngine on the double (rank `rank` of `world_size`), its RolloutConfig fields from `config`."""
    os.environ["RANK"] = str(rank)  # as torchrun sets it (the torchrun_env fixture restores it)
    return VLLMEngine(RolloutConfig(engine="vllm", **config), "/ckpt/qwen", rank=rank, world_size=world_size,
                      local_rank=0, max_model_len=64, seed=5, tp_gather=tp_gather, vllm_module=vllm_module)


def push(engine, tied=False):
    """The RolloutEngine contract's wake: the engine pulls the weights in its own dtype."""
    hf = tiny_qwen2(tied)
    engine.wake(lambda dtype: iter_full_state_dict(hf, dtype=dtype))


def names(calls):
    """The recorded calls by name (sleep and wake_up with their arguments)."""
    return [c if c[0] in ("sleep", "wake_up") else c[0] for c in calls]


# ---------------------------------------------------------------------------------------------------
# Streaming: vLLM's step-wise engine


class RequestOutputKind(enum.Enum):  # vllm/sampling_params.py
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class StreamSamplingParams(FakeSamplingParams):
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


def script(seed: int, max_tokens: int) -> tuple[list[int], list[float], str]:
    """What a request with this seed samples: its tokens, their log-probs, its finish reason."""
    g = torch.Generator().manual_seed(seed)
    length = int(torch.randint(1, max_tokens + 1, (1,), generator=g))
    tokens = torch.randint(3, 40, (length,), generator=g).tolist()
    reason = "length" if length == max_tokens else "stop"
    if reason == "stop":
        tokens[-1] = EOS
    return tokens, (-torch.rand(length, generator=g) * 5).tolist(), reason


@dataclasses.dataclass
class _Running:
    request_id: str
    tokens: list[int]
    logprobs: list[float]
    reason: str
    emitted: int = 0


class FakeStepEngine:
    """`llm.llm_engine`: FCFS, at most `max_num_seqs` running, one sampled token per running request a step."""

    max_num_seqs = 3
    finish_override: str | None = None

    def __init__(self):
        self.calls, self.waiting, self.running = [], deque(), {}

    def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None,
                    tokenization_kwargs=None, trace_headers=None, priority=0, session_id=None,
                    prompt_text=None, kv_hints=None):
        assert isinstance(request_id, str) and params.n == 1
        assert request_id not in self.running and all(r.request_id != request_id for r in self.waiting)
        self.calls.append(("add", request_id, list(prompt["prompt_token_ids"]), params))
        self.waiting.append(_Running(request_id, *script(params.seed, params.max_tokens)))
        return request_id

    def step(self):
        self.calls.append(("step",))
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            self.running[request.request_id] = request
        outputs = []
        for request in list(self.running.values()):
            tok, lp = request.tokens[request.emitted], request.logprobs[request.emitted]
            request.emitted += 1
            finished = request.emitted == len(request.tokens)
            reason = (self.finish_override or request.reason) if finished else None
            delta = SimpleNamespace(token_ids=[tok], logprobs=FakeFlatLogprobs([0], [1], [tok], [lp]),
                                    finish_reason=reason)
            outputs.append(SimpleNamespace(request_id=request.request_id, finished=finished, outputs=[delta]))
            if finished:
                del self.running[request.request_id]
        return outputs

    def abort_request(self, request_ids, internal=False):
        self.calls.append(("abort", list(request_ids)))
        self.waiting = deque(r for r in self.waiting if r.request_id not in request_ids)
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)


class StreamLLM(FakeLLM):
    """FakeLLM with the step-wise engine as `llm_engine`, as vLLM's LLM holds one."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self.llm_engine = FakeStepEngine()


STREAM_VLLM = SimpleNamespace(**{**vars(fake_vllm(StreamLLM)), "SamplingParams": StreamSamplingParams,
                                 "RequestOutputKind": RequestOutputKind})

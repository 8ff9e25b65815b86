"""Pushing the trainer's weights into a running vLLM engine, in place (vLLM 0.32 CPU build, 0.33 and 0.34,
whose reload API is the same; paths inside the wheel), and recording where its forward parts from the
trainer's (`vllm_group_outputs`, for the push check's message).

The choices, before the code:

- **The reload API.** After start-up a layer's parameters are no longer what its weight loaders expect: on
  vLLM's CPU platform every linear weight is replaced by a packed copy for oneDNN / the SGL kernels and a
  bare `Parameter` without `weight_loader` (`model_executor/layers/utils.py`,
  `dispatch_cpu_unquantized_gemm`), so a plain `model.load_weights` crashes (`'Parameter' object has no
  attribute 'weight_loader'`); quantized layers are repacked likewise on GPUs. vLLM's supported way to
  load new weights into a running engine is its layerwise reload (`model_executor/model_loader/reload/`):
  `collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format": True})`
  (`v1/worker/gpu_worker.py` -> `gpu_model_runner.py` `reload_weights` -> `reload/inplace.py`) puts every
  layer back in its checkpoint form, buffers the weights streamed for it, and when a layer has all of
  them loads them with the original loaders, runs its `process_weights_after_loading` (repacking) and
  copies the result into the original storage. HF names go in unchanged: vLLM's Qwen2 loader stacks
  q/k/v into `qkv_proj` and gate/up into `gate_up_proj` and slices for TP (`models/qwen2.py`). With
  external_launcher the worker runs in this process (`v1/executor/uniproc_executor.py` `collective_rpc`),
  so the iterator may be a generator that all-gathers FSDP2 shards as it goes. The iterator is always
  given: without it `reload_weights` reads the checkpoint from disk and silently undoes training (trl#5312).
- **Tied heads.** A tied `lm_head.weight` is never streamed (HF checkpoints do not hold it; it is the
  embedding). vLLM's lm_head is then a layer of its own whose weight *is* the embedding's Parameter
  (`vocab_parallel_embedding.py` `tie_weights`): the reload refreshes the shared tensor through the
  embedding, but skips the head's processing ("Tied parameters will only reflect processing from one of
  the parent layers", `reload/__init__.py`). On CPU the head's packed copy would stay stale (the issue's
  0.25 mean / 0.76 max |delta logp| after a push). So after the stream, the head's
  `quant_method.process_weights_after_loading` runs again (a no-op on CUDA for unquantized heads).
- **Completeness.** Every vLLM parameter must be the target of a streamed tensor, and every stacked one
  must get all its shards; else RuntimeError (a parameter left out would keep its dummy or older values).
  The names are read before the reload (during it, layers are on the meta device).
- **Mixture-of-experts.** transformers 5 holds a MoE layer's routed experts fused
  (`...mlp.experts.gate_up_proj` [E, 2I, H], `...mlp.experts.down_proj` [E, H, I]); vLLM's MoE families load
  per-expert checkpoint names (`...mlp.experts.<e>.{gate,up,down}_proj.weight`, mapped by
  `RoutedExperts.build_expert_params_mapping` into `...mlp.experts[.routed_experts].w13_weight` shards w1/w3
  and `w2_weight`), and only some also take the fused ones (Qwen3-MoE does, DeepSeek-V3 does not). So for
  those families (`Family.engine_experts` "per_expert") the stream is split into per-expert tensors first
  (`models/moe/expert_layout.py`: views, no copy), and completeness asks every expert's w1, w3 and w2 of every
  layer (a fused tensor left fused counts for all; the global expert count: with expert parallelism each rank
  still reads every expert and keeps its own).
- **MoE on vLLM's CPU build.** Its MoE kernel pads `moe_intermediate_size` up to its alignment at start-up
  (32 for the portable kernel, `fused_moe/experts/cpu_moe.py`), and the in-place reload then fails to copy
  the unpadded reloaded weights into that storage (a size mismatch), so there `moe_intermediate_size` must be
  a multiple of 32 (real models' are). And as with the tied head, the reload skips a step of its MoE
  processing: at start-up `CPUUnquantizedExperts.process_weights_after_loading` prepacks w13 and
  w2 into its grouped-GEMM layout, but on a weight update `UnquantizedFusedMoEMethod._setup_kernel` only
  copies the reloaded weights into that storage, unpacked, and the experts then compute garbage (measured:
  a 2-layer model's MoE outputs off by more than their own size, 0.02 |delta logp|, where loading the same
  weights from disk agrees to 4e-7). So after the stream each such layer's weights are prepacked again, in
  place (`_repack_cpu_experts`; nothing on CUDA, whose unquantized kernels use the plain layout).
- **Multi-head latent attention (DeepSeek-V3).** vLLM stacks q_a_proj and kv_a_proj_with_mqa into
  `fused_qkv_a_proj` (STACKED) and derives `W_UV` / `W_UK_T` from kv_b_proj: the reload runs each attention
  layer's `process_weights_after_loading` after all other layers (`reload/layerwise.py`
  `_finalize_attention_layer`), so they follow the pushed kv_b_proj (measured on vLLM's CPU build: equal to
  those split from it, to the bit), and completeness counts them written with their kv_b_proj. (vLLM's CPU
  build then computes the model differently from transformers, pushed or loaded from disk alike, so
  `models/hf.py` `vllm_refusal` refuses the family there.)
- **GPT-OSS.** vLLM's GptOssForCausalLM loads its own names (`model.embedding`, `.attn.`) and copies whole
  fused experts and the attention sinks with `param.copy_`, past the weight loaders the reload buffers through
  (lost: the layer is on the meta device then). So its stream is renamed and split one expert at a time,
  weights and biases (`models/moe/gpt_oss_layout.py`), completeness asks every expert's w13/w2 weight and
  bias, and the sinks are held out of the stream and copied into their parameters after the reload
  (`_load_sinks`). vLLM then logs, on each push, "OAIAttention: Failed to load weights" and "Following weights
  were not loaded from checkpoint: {...attn.sinks}": the reload put the old sinks back, which the copy
  replaces; the push check compares the forwards after it.
- **LoRA** (`push_adapters`). vLLM then runs with `enable_lora` over the base it loaded from model.path (never
  pushed: the trainer's base is frozen), and a push hands it only the adapters, from memory:
  `LoRAModel.from_lora_tensors` of the gathered tensors (PEFT names; `PEFTHelper.from_dict` of the run's peft
  config, validated as vLLM validates an adapter directory, `lora/worker_manager.py` `_load_adapter`), put
  into the worker's LoRA manager (`model_runner.lora_manager._adapter_manager`: the worker runs in this
  process) under a new id after the previous version is removed, and activated (its slots written). Requests
  then name it by a `LoRARequest` of that id: the LRU worker manager only loads from the request's path an id
  it does not hold (`LRUCacheWorkerLoRAManager.add_adapter`), so the path (`LORA_PATH`, which does not exist)
  is never read (measured: equal log-probs to 5e-7 in fp32 on the CPU build). A new id and name per push also
  keep the prefix cache from matching KV computed with older adapters (its block hashes hold the name,
  `v1/core/kv_cache_utils.py`). vLLM is given copies (it scales B in place, `lora_weights.py` `optimize`).
  Every adapted module must land on one of vLLM's LoRA layers, itself or stacked with others by its model's
  `packed_modules_mapping` (`lora_gaps`, asked once at start: one that does not is refused there).
  The norms `lora.train_norms` trains are no adapter vLLM takes (its LoRA accepts modules_to_save only for a
  classifier head), so they go into its base with the model's own `load_weights`, these tensors alone
  (`push_norms`); the new adapter id of the same push keeps the prefix cache from reusing KV computed with
  the old norms.
"""

from __future__ import annotations

import functools
import re
import time
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models.hf import FAMILIES, group_modules
from ..models.lora import ADAPTER, AdapterLayout, peft_name
from ..models.moe.expert_layout import fused_expert_name, per_expert_name, split_experts
from ..models.moe.gpt_oss_layout import is_sinks, to_vllm_gpt_oss
from .check import adapter_digest, stream_of

__all__ = [
    "LORA_NAME", "LORA_PATH", "STACKED", "VLLM_LORA_RANKS", "AdapterPush", "expert_target", "lora_gaps",
    "max_lora_rank", "push_adapters", "push_weights", "vllm_group_outputs", "vllm_target"
]

STACKED: tuple[tuple[str, str, str | int | tuple[int, ...]], ...] = (
    (".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1),
    (".in_proj_qkv", ".in_proj_qkvz", (0, 1, 2)), (".in_proj_z", ".in_proj_qkvz", 3),
    (".in_proj_b", ".in_proj_ba", 0), (".in_proj_a", ".in_proj_ba", 1),
    (".q_a_proj", ".fused_qkv_a_proj", 0), (".kv_a_proj_with_mqa", ".fused_qkv_a_proj", 1),
)
"""vLLM Qwen2Model.hf_to_vllm_mapper `orig_to_new_stacked`: HF substring -> (vLLM substring, shard); and
Qwen3_5Model's (models/qwen3_5.py: Qwen3.5 ships its Gated DeltaNet input projections apart, vLLM stacks
them). In order: `.in_proj_b` before `.in_proj_a` (the name `.in_proj_b` becomes holds no `.in_proj_a`). And
DeepSeek-V2/V3's multi-head latent attention (models/deepseek_v2.py `mla_params_mapping`: q_a_proj and
kv_a_proj_with_mqa stack into `fused_qkv_a_proj` where the model has a q_lora_rank; mapped always here: every
DeepSeek-V3 has one)."""
_SHARDS = {".qkv_proj": {"q", "k", "v"}, ".gate_up_proj": {0, 1}, ".in_proj_qkvz": {(0, 1, 2), 3},
           ".in_proj_ba": {0, 1}, ".fused_qkv_a_proj": {0, 1}}
_DERIVED = re.compile(
    r"^(?P<attn>.*?)\.mla_attn\.(?:[\w.]*\.)?(?:W_UV|W_UK_T|W_UK_T_dcp_qrep|W_K|W_K_scale|W_V|W_V_scale)$")
"""vLLM's multi-head latent attention parameters computed from `kv_b_proj` rather than loaded (`W_UV`,
`W_UK_T`: layers/attention/mla_attention.py `MLAAttention.process_weights_after_loading`, which the reload
runs again for every attention layer after all others are loaded, `reload/layerwise.py`
`_finalize_attention_layer`): reached when their layer's kv_b_proj is."""


def vllm_target(name: str) -> tuple[str, str | int | None]:
    """The vLLM parameter an HF tensor lands in, and its shard of a stacked parameter (None if unstacked)."""
    shard = None
    for hf_part, vllm_part, shard_id in STACKED:
        if hf_part in name:
            name, shard = name.replace(hf_part, vllm_part, 1), shard_id
    return name, shard


_EXPERT_PARAMETER = re.compile(
    r"^(?P<experts>.*?\.mlp\.experts)\.(?:[\w.]*\.)?(?P<kind>(?:w13|w2)_(?:weight|bias))$")
"""vLLM's fused-MoE weights and biases (`model.layers.0.mlp.experts.routed_experts.w13_weight`,
`...experts.w2_weight` before vLLM 0.32, GPT-OSS's `...w13_bias`): the HF experts module they load, and
which."""
_VLLM_PER_EXPERT = re.compile(
    r"^(?P<experts>(?:.*\.)?mlp\.experts)\.(?P<index>\d+)\.(?P<kind>(?:w13|w2)_(?:weight|bias))$")
"""A per-expert tensor in vLLM's own names (GPT-OSS's streamed experts: `...mlp.experts.3.w13_weight`)."""
_WHOLE = {"w13": ({"w1", "w3"}, {"w13"}), "w2": ({"w2"},)}
"""The shard sets that complete one expert of a w13 / w2 parameter: gate and up apart, or together."""


def expert_target(name: str) -> tuple[tuple[str, str], tuple[int, str]] | None:
    """((HF experts module, vLLM parameter 'w13_weight' | 'w2_weight' | 'w13_bias' | 'w2_bias'), (expert,
    shard 'w1' | 'w3' | 'w2' | 'w13')) a per-expert tensor loads into: an HF name (gate / up / down
    projection, shards w1 / w3 / w2) or vLLM's own (`...experts.3.w13_weight`, the whole w13 or w2 of that
    expert); None for any other name."""
    parsed = per_expert_name(name)
    if parsed is not None:
        experts, index, proj = parsed
        shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
        return (experts, "w2_weight" if shard == "w2" else "w13_weight"), (index, shard)
    match = _VLLM_PER_EXPERT.match(name)
    if match is None:
        return None
    return (match["experts"], match["kind"]), (int(match["index"]), match["kind"].split("_")[0])


ENGINE_EXPERTS: dict[str | None, Callable[[Iterable[tuple[str, torch.Tensor]]], tuple[Iterable[tuple[
    str, torch.Tensor]], Callable[[str], bool] | None]]] = {
        None: lambda stream: (stream, None),
        # per-expert names, which vLLM's MoE loaders map
        "per_expert": lambda stream: (split_experts(stream), None),
        # vLLM's GPT-OSS names, experts one by one, the sinks held out and copied after the reload
        "gpt_oss": lambda stream: (to_vllm_gpt_oss(stream), is_sinks),
    }
"""The stream of a family's tensors as vLLM loads them, by `Family.engine_experts` (models/hf.py), and the
names held out of the reload (loaded after it)."""


class _Tracked:
    """The stream, recording which vLLM parameters (and stacked shards, and experts) it reached; the tensors
    `hold` names are kept out of it (in `held`, copied: loaded after the reload) and count as reached."""

    def __init__(self, stream: Iterable[tuple[str, torch.Tensor]], hold: Callable[[str], bool] | None = None):
        self.stream, self.targets, self.shards = stream, set(), {}
        self.experts: dict[tuple[str, str], set[tuple[int, str]]] = {}
        self.fused: set[tuple[str, str]] = set()
        self.hold, self.held = hold, {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.stream:
            if self.hold is not None and self.hold(name):
                self.held[name] = tensor.detach().clone()
                self.targets.add(name)
                continue
            expert, fused = expert_target(name), fused_expert_name(name)
            if expert is not None:
                self.experts.setdefault(expert[0], set()).add(expert[1])
            elif fused is not None:  # every expert at once
                self.fused.add((fused[0], "w2_weight" if fused[1] == "down_proj" else "w13_weight"))
            else:
                target, shard = vllm_target(name)
                self.targets.add(target)
                if shard is not None:
                    self.shards.setdefault(target, set()).add(shard)
            yield name, tensor
            del tensor

    def gaps(self, expected: list[str], num_experts: int | None = None) -> tuple[list[str], list[str]]:
        """(vLLM parameters no tensor reached, stacked parameters short of shards: an expert parameter short
        of any of the `num_experts` experts' shards, too)."""
        missing, partial = [], []
        for name in expected:
            derived = _DERIVED.match(name)
            if derived is not None:  # recomputed from kv_b_proj by the reload
                if f"{derived['attn']}.kv_b_proj.weight" not in self.targets:
                    missing.append(name)
                continue
            match = _EXPERT_PARAMETER.match(name)
            if match is None:
                if name not in self.targets:
                    missing.append(name)
                continue
            if (match["experts"], match["kind"]) in self.fused:
                continue
            got = self.experts.get((match["experts"], match["kind"]))
            if not got:
                missing.append(name)
                continue
            count = num_experts or 1 + max(index for index, _ in got)
            per_expert: dict[int, set[str]] = {}
            for index, shard in got:
                per_expert.setdefault(index, set()).add(shard)
            whole = _WHOLE[match["kind"].split("_")[0]]
            if set(per_expert) != set(range(count)) or any(shards not in whole
                                                           for shards in per_expert.values()):
                partial.append(name)
        partial += [
            t for t, got in self.shards.items() if any(k in t and got != need for k, need in _SHARDS.items())
        ]
        return missing, partial


def _parameter_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _model_facts(model: torch.nn.Module) -> tuple[list[str], int | None, str | None]:
    """(parameter names, routed experts per layer, config.json model type) of vLLM's model: the expert count
    is all ranks' together (vLLM's MixtureOfExperts interface; else the config's `num_local_experts`,
    GPT-OSS's, whose vLLM model has no such interface), None for a dense model."""
    config = getattr(model, "config", None)
    experts = getattr(model, "num_logical_experts", None) or getattr(config, "num_local_experts", None)
    return _parameter_names(model), experts, getattr(config, "model_type", None)


def _load_sinks(sinks: dict[str, torch.Tensor], model: torch.nn.Module) -> int:
    """Copy full [heads] attention-sinks tensors into vLLM's model in place, each rank its own heads (the
    parameter holds heads / tensor-parallel size of them, rank r's from r times that on, as vLLM's GPT-OSS
    loader narrows them); how many it copied."""
    from vllm.distributed import get_tensor_model_parallel_rank

    params = dict(model.named_parameters())
    rank = get_tensor_model_parallel_rank()
    for name, full in sinks.items():
        param = params[name]
        heads = param.shape[0]
        param.data.copy_(full.narrow(0, rank * heads, heads).to(device=param.device, dtype=param.dtype))
    return len(sinks)


def _reprocess_tied_head(model: torch.nn.Module) -> bool:
    """Run a tied lm_head's weight processing again (see the module docstring); True if there was one."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def _repack_cpu_experts(model: torch.nn.Module) -> int:
    """Prepack again, in place, the MoE weights vLLM's CPU experts kernel holds prepacked (see the module
    docstring); how many MoE layers it repacked (0 without vLLM's CPU MoE kernel)."""
    layers = [
        (module, module.quant_method.moe_kernel.fused_experts) for module in model.modules()
        if getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    ]
    if not layers:
        return 0
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # another build, or a vLLM without the CPU MoE kernel: nothing is prepacked
        return 0
    repacked = 0
    for module, experts in layers:
        if type(experts) is not CPUUnquantizedExperts or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(module, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        repacked += 1
    return repacked


def push_weights(llm: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load full HF-named tensors into the running engine through vLLM's layerwise reload; raise if the
    stream left a parameter (or a shard of a stacked one) unloaded."""
    expected, num_experts, model_type = llm.apply_model(_model_facts)[0]
    family = FAMILIES.get(model_type)
    named_tensors, hold = ENGINE_EXPERTS[family.engine_experts if family is not None else None](named_tensors)
    tracked = _Tracked(named_tensors, hold)
    llm.collective_rpc("reload_weights",
                       kwargs={"weights_iterator": iter(tracked), "is_checkpoint_format": True})
    llm.apply_model(_reprocess_tied_head)
    if tracked.held:
        llm.apply_model(functools.partial(_load_sinks, tracked.held))
    if num_experts:
        llm.apply_model(_repack_cpu_experts)
    missing, partial = tracked.gaps(expected, num_experts)
    if missing or partial:
        raise RuntimeError(f"weight push left vLLM parameters unloaded: {missing[:8]} (of {len(missing)}); "
                           f"stacked parameters missing shards: {partial[:8]}")


# ---------------------------------------------------------------------------------------------------
# LoRA: the adapters alone, from memory (the module docstring's "LoRA")

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM 0.32-0.34 accept (`config/lora.py` MaxLoRARanks), where vLLM is not
importable (`flashdapo plan`); the installed vLLM's own list otherwise."""
LORA_NAME = "flashdapo-policy"
"""The LoRARequest's name, with the push's id after it."""
LORA_PATH = "/nonexistent/flashdapo/adapters-pushed-from-memory"
"""The LoRARequest's path: vLLM wants one, and never reads it for an adapter its manager holds (a path that
exists nowhere, so that reading it would fail loudly rather than load another adapter)."""


def vllm_lora_ranks() -> tuple[int, ...]:
    """The max_lora_rank values the installed vLLM accepts (VLLM_LORA_RANKS where it is not installed)."""
    try:
        from vllm.config.lora import MaxLoRARanks
    except ImportError:
        return VLLM_LORA_RANKS
    return tuple(sorted(int(r) for r in typing.get_args(MaxLoRARanks))) or VLLM_LORA_RANKS


def max_lora_rank(rank: int, accepted: Iterable[int] | None = None) -> int | None:
    """vLLM's max_lora_rank for adapters of `rank`: the smallest value it accepts that holds them (vLLM pads
    smaller adapters in its slots); None above its largest."""
    return next((r for r in sorted(accepted or vllm_lora_ranks()) if r >= rank), None)


@dataclass(frozen=True)
class AdapterPush:
    """One LoRA push: the adapter id vLLM holds it under, what it took and the digest of what it was given
    (sync/check.py `adapter_digest`, compared by the push check with the trainer's current adapters)."""

    lora_id: int
    tensors: int
    bytes: int
    """Bytes of the adapters as vLLM holds them (its lora_dtype: the model's dtype)."""
    seconds: float
    """From the first tensor gathered to the adapter active in vLLM."""
    digest: str

    @property
    def name(self) -> str:
        return f"{LORA_NAME}-{self.lora_id}"


def _lora_manager(worker: Any) -> tuple[Any, Any]:
    """(vLLM's worker LoRA manager, its model manager) of the worker's model runner."""
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None:
        raise RuntimeError("vLLM's model runner holds no LoRA manager (model_runner.lora_manager): the "
                           "engine was started without enable_lora, or this vLLM keeps it elsewhere")
    return manager, manager._adapter_manager


def _weights_mapper(adapters: Any) -> Any:
    """vLLM's renames of the model's checkpoint names (only the renames: stacking is the LoRA manager's), as
    its own adapter loader applies them."""
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    return mapper.get_rename_mapper() if mapper is not None else None


def _vllm_modules(adapters: Any, modules: Iterable[str]) -> dict[str, str]:
    """The vLLM module name each adapted HF module's adapter loads into (before stacking)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    mapper = _weights_mapper(adapters)
    return {m: parse_fine_tuned_lora_name(peft_name(f"{m}.lora_A.{ADAPTER}.weight"), mapper)[0]
            for m in modules}


def lora_gaps(layout: AdapterLayout, worker: Any) -> list[str]:
    """The adapted modules (HF names) no LoRA layer of vLLM's model takes: neither a LoRA-wrapped module of
    their name nor a stacked one that packs them (`packed_modules_mapping`). For `collective_rpc`."""
    _, adapters = _lora_manager(worker)
    held = set(adapters.modules) | {sub for subs in adapters.packed_modules.values() for sub in subs}
    return [hf for hf, name in _vllm_modules(adapters, layout.adapted).items() if name not in held]


def _install_adapter(worker: Any, *, layout: AdapterLayout, tensors: dict[str, torch.Tensor],
                     lora_id: int) -> int:
    """Build vLLM's LoRAModel of `tensors` (PEFT-named, full), put it in the worker's LoRA manager in place of
    every adapter there and activate it; the bytes it holds. For `collective_rpc` (every worker)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager, adapters = _lora_manager(worker)
    helper = PEFTHelper.from_dict({**layout.peft_config().to_dict(),
                                   "target_modules": list(layout.target_modules),
                                   "modules_to_save": None,  # the trained norms: push_norms
                                   "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)  # rank within max_lora_rank, no feature vLLM lacks
    dtype = manager.lora_config.lora_dtype
    dtype = dtype if isinstance(dtype, torch.dtype) else None
    # copies on the host, as vLLM's own loader reads them: vLLM scales B in place
    held = {name: t.detach().to(device="cpu", dtype=dtype, copy=True) for name, t in tensors.items()}
    model = LoRAModel.from_lora_tensors(lora_id, held, helper, device="cpu", dtype=dtype,
                                        model_vocab_size=manager.vocab_size,
                                        weights_mapper=_weights_mapper(adapters),
                                        skip_prefixes=getattr(adapters.model, "lora_skip_prefixes", None))
    expected = set(_vllm_modules(adapters, layout.adapted).values())
    if set(model.loras) != expected:
        raise RuntimeError(f"LoRA push: vLLM read adapters for {sorted(set(model.loras) - expected)[:4]}, "
                           f"and none for {sorted(expected - set(model.loras))[:4]}")
    for old in list(adapters.list_adapters()):
        adapters.remove_adapter(old)
    adapters.add_adapter(model)
    adapters.activate_adapter(lora_id)
    if lora_id not in adapters.lora_index_to_id:
        raise RuntimeError(f"LoRA push: vLLM did not activate adapter {lora_id} (its slots hold "
                           f"{adapters.lora_index_to_id})")
    return sum(t.numel() * t.element_size() for t in held.values())


def push_adapters(llm: Any, named: Iterable[tuple[str, torch.Tensor]], layout: AdapterLayout,
                  lora_id: int) -> AdapterPush:
    """Give the running engine the adapters of `named` (`WeightSource.adapters()`: PEFT names, full fp32
    tensors; read to its end here, so that every rank consumes the all-gathers) as adapter `lora_id`, in place
    of the one it held; raise if the stream lacks an adapted module's A or B or holds another tensor."""
    start = time.perf_counter()
    tensors = dict(named)
    expected = {peft_name(f"{m}.lora_{part}.{ADAPTER}.weight") for m in layout.adapted for part in "AB"}
    norms = {peft_name(name): name for name in layout.norms}
    missing = sorted((expected | set(norms)) - set(tensors))
    stray = sorted(set(tensors) - expected - set(norms))
    if missing or stray:
        raise RuntimeError(f"LoRA push: the adapter stream lacks {missing[:4]} (of {len(missing)}) and holds "
                           f"{stray[:4]} (of {len(stray)}) beside the adapters of the run's layout")
    digest = adapter_digest(tensors.items())
    size = llm.collective_rpc(_install_adapter, kwargs={
        "layout": layout, "tensors": {name: t for name, t in tensors.items() if name in expected},
        "lora_id": lora_id})[0]
    if norms:
        size += push_norms(llm, {plain: tensors[name] for name, plain in norms.items()})
    return AdapterPush(lora_id, len(tensors), int(size), time.perf_counter() - start, digest)


def push_norms(llm: Any, norms: dict[str, torch.Tensor]) -> int:
    """Load the trained norms (plain HF names, full tensors) into the running engine's base, where LoRA
    requests cannot carry them (vLLM's adapters take no modules_to_save but a classifier's): the model's own
    `load_weights`, given these tensors alone; raise if it loaded fewer. The bytes vLLM holds them in."""
    size = 0
    for loaded, nbytes in llm.apply_model(functools.partial(_load_norms, norms)):
        if len(loaded) != len(norms):
            raise RuntimeError(f"LoRA push: vLLM's load_weights took {sorted(loaded)[:4]} for the trained "
                               f"norms {sorted(norms)[:4]} ({len(loaded)} of {len(norms)})")
        size = nbytes
    return size


def _load_norms(norms: dict[str, torch.Tensor], model: nn.Module) -> tuple[list[str], int]:
    """For `apply_model`: load `norms` with the model's load_weights; the (vLLM) names it reports loaded
    and their bytes as held."""
    given = [(name, t.detach().to("cpu")) for name, t in norms.items()]
    loaded = sorted(model.load_weights(iter(given)) or ())
    held = {name: p for name, p in model.named_parameters() if isinstance(p, torch.Tensor)}
    return loaded, sum(held[name].numel() * held[name].element_size() for name in loaded if name in held)


# ---------------------------------------------------------------------------------------------------
# Where the forwards part (after a failed push check)
#
# Forward hooks on the family's parameter groups (models/hf.py; Qwen2-style: `model.embed_tokens`,
# `model.layers[i]`, `model.norm`) record their outputs while the engine scores one sequence (one request: its
# tokens are the rows of vLLM's flattened batch, in order). Under tensor parallelism these outputs are already
# all-reduced (full on every rank). Hooks do not fire inside captured CUDA graphs or compiled regions: then
# nothing is recorded and the push check says so.


def vllm_group_outputs(llm: Any, score: Callable[[], Any], model_type: str) -> dict[str, torch.Tensor]:
    """Run `score()` (one sequence through the engine) with hooks on vLLM's groups; their outputs by name
    (the last call of each, i.e. the sequence's prefill), empty where no hook fired."""
    captured: dict[str, torch.Tensor] = {}
    handles: list[Any] = []

    def attach(model: nn.Module) -> None:
        for name, module in group_modules(model, model_type):
            handles.append(module.register_forward_hook(
                lambda _m, _inputs, out, name=name: captured.__setitem__(name, stream_of(name, out))))

    llm.apply_model(attach)
    try:
        score()
    finally:
        for handle in handles:
            handle.remove()
    return captured

"""The model built on the meta device (no weights, no memory): every parameter tensor's exact shape, the
FSDP2 unit it belongs to and whether it is a routed expert's, and the dimensions the memory and time models
read (for a mixture-of-experts model also its experts: plan/moe.py).

Under LoRA (lora.rank r > 0) the shape also holds the adapters the trainer would put on the model: the
modules models/lora.py `adapter_layout` picks (the family's `adapter_modules`, or lora.target_modules; the
same matching and the same refusal as the launch), each adapted linear [out, in] adding A [r, in] and
B [out, r] to its decoder block's FSDP2 unit. The adapters train; every other tensor is the frozen base."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..config import Config, LoraConfig
from ..models.hf import layer_configs
from ..models.lora import ADAPTER, adapter_layout
from ..models.ulysses import layer_heads
from .moe import MoeShape, expert_gathered_numel, expert_shard_numel, moe_shape
from .shapes import ModelSource


@dataclass(frozen=True)
class Tensor:
    """One parameter: its HF name, shape and FSDP2 unit ('layers.<i>', or 'root' for embeddings, final
    norm and LM head); `expert`: a routed expert's [num_experts, ...] tensor (sharded by expert
    parallelism)."""

    name: str
    shape: tuple[int, ...]
    unit: str
    expert: bool = False
    adapter: bool = False
    """A LoRA adapter's A or B (trains; under LoRA every other tensor is the frozen base but `whole`)."""
    whole: bool = False
    """Under LoRA, a norm trained whole beside the adapters (lora.train_norms)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_numel(self, world: int, rank: int) -> int:
        """Elements of rank `rank`'s FSDP2 shard: dim 0 split as torch.chunk does (ceil(d0 / world) rows per
        rank, the last ranks fewer or none)."""
        if not self.shape:
            return 1 if rank == 0 else 0
        rows = -(-self.shape[0] // world)
        mine = max(0, min(rows, self.shape[0] - rank * rows))
        return mine * math.prod(self.shape[1:])

    def padded_numel(self, world: int) -> int:
        """Elements of one rank's padded shard (what FSDP2 allocates and all-gathers per rank)."""
        if not self.shape:
            return 1
        return -(-self.shape[0] // world) * math.prod(self.shape[1:])

    def shard_numel(self, world: int, rank: int, expert_parallel: int = 1) -> int:
        """Elements of rank `rank`'s shard as the trainer lays it out: an expert tensor under expert
        parallelism E > 1 as plan/moe.py says, every other tensor (and all of them at E = 1) by FSDP2
        alone."""
        if self.expert and expert_parallel > 1:
            return expert_shard_numel(self.shape, world, rank, expert_parallel)
        return self.local_numel(world, rank)

    def gathered_numel(self, world: int, expert_parallel: int = 1) -> int:
        """Elements a rank holds of this tensor all-gathered (padded shards x the ranks gathering them): the
        whole tensor, or an expert tensor's 1/E under expert parallelism E > 1."""
        if self.expert and expert_parallel > 1:
            return expert_gathered_numel(self.shape, world, expert_parallel)
        return self.padded_numel(world) * world


@dataclass(frozen=True)
class ModelShape:
    """What the plan knows of the model: its tensors and dimensions."""

    name: str
    tensors: tuple[Tensor, ...]
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    max_positions: int | None
    model_type: str
    layer_heads: tuple[tuple[int, int], ...]
    """(query heads, key/value heads) of each kind of attention layer (models/ulysses.py layer_heads)."""
    layer_kv: tuple[tuple[int, int], ...]
    """(key/value heads, head dim) of every layer: they vary in Gemma 4, whose full-attention layers have
    their own key/value heads and a wider head (heads, kv_heads and head_dim are then the first layer's)."""
    moe: MoeShape | None = None
    """The routed experts of a mixture-of-experts model; None: dense."""
    lora_rank: int = 0
    """LoRA's rank r when the shape holds adapters (0: the whole model trains)."""

    @property
    def parameters(self) -> int:
        """Every parameter (what memory holds), a LoRA model's adapters included."""
        return sum(t.numel for t in self.tensors)

    @property
    def lora(self) -> bool:
        """Whether adapters train over a frozen base."""
        return self.lora_rank > 0

    @property
    def adapter_parameters(self) -> int:
        """The LoRA adapters' parameters (0 without LoRA)."""
        return sum(t.numel for t in self.tensors if t.adapter)

    @property
    def base_parameters(self) -> int:
        """The model's own parameters (the frozen base under LoRA)."""
        return self.parameters - self.adapter_parameters

    @property
    def trainable_parameters(self) -> int:
        """What trains: the adapters and the norms trained whole under LoRA, else every parameter."""
        return sum(t.numel for t in self.tensors if self.trainable(t))

    def trainable(self, tensor: Tensor) -> bool:
        """Whether `tensor` trains (has gradients and AdamW moments)."""
        return tensor.adapter or tensor.whole or not self.lora

    @property
    def expert_parameters(self) -> int:
        """The routed experts' parameters (0 for a dense model)."""
        return sum(t.numel for t in self.tensors if t.expert)

    @property
    def active_parameters(self) -> int:
        """Parameters one token runs through: all but the routed experts, plus top_k / num_experts of those
        (attention, router, shared experts, embeddings and LM head count whole). Equal to `parameters` for a
        dense model."""
        if self.moe is None:
            return self.parameters
        routed = self.expert_parameters * self.moe.top_k // self.moe.num_experts
        return self.parameters - self.expert_parameters + routed

    @property
    def mlp_width(self) -> int:
        """The widest MLP activation per token of a block: the dense intermediate, or an MoE layer's top-k
        experts plus its shared experts."""
        dense = self.intermediate if self.moe is None or self.moe.moe_layers < self.layers else 0
        return max(dense, self.moe.routed_width if self.moe else 0)

    def layer_units(self) -> list[str]:
        """The decoder blocks' FSDP2 unit names."""
        return sorted({t.unit for t in self.tensors if t.unit != "root"}, key=lambda u: int(u.split(".")[1]))

    def unit_tensors(self, unit: str) -> list[Tensor]:
        return [t for t in self.tensors if t.unit == unit]

    @property
    def lm_head_parameters(self) -> int:
        return self.vocab * self.hidden

    @property
    def kv_dim(self) -> int:
        """The widest key (or value) projection of a layer: its key/value heads times its head dim."""
        return max(kv * dim for kv, dim in self.layer_kv)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def build_meta_model(source: ModelSource, cfg: Config) -> torch.nn.Module:
    """The HF model of `source` on the meta device, as the trainer builds it (fp32; the toy through the
    trainer's own builder)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        if source.toy:
            from ..tasks import build_task_tokenizer
            from ..tasks.toy import build_toy_model

            max_positions = cfg.data.max_prompt_length + cfg.rollout.max_response_length + 8
            return build_toy_model(cfg.model, len(build_task_tokenizer(cfg.data)), max_positions,
                                   cfg.trainer.seed)
        # A quantized checkpoint is trained dequantized (models/quantized.py): its plain model is counted.
        values = {
            k: v
            for k, v in source.config.items()
            if k not in ("architectures", "model_type", "quantization_config")
        }
        config = AutoConfig.for_model(source.config["model_type"], **values)
        # Eager attention: every family has it (GPT-OSS has no SDPA path) and the shapes do not depend on it.
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")


def model_shape(model: torch.nn.Module, name: str, lora: LoraConfig | None = None) -> ModelShape:
    """Tensors (tied weights once, as named_parameters lists them) and dimensions of a meta-built model;
    with `lora` enabled its adapters too (`adapter_tensors`; ConfigError for target modules that match no
    linear layer, as the launch refuses them)."""
    moe, expert_names = moe_shape(model)
    rank = lora.rank if lora is not None and lora.enabled else 0
    whole = set(adapter_layout(model, lora).norms) if rank else set()
    tensors = []
    for pname, param in model.named_parameters():
        tensors.append(Tensor(pname, tuple(param.shape), _unit(pname), expert=pname in expert_names,
                              whole=pname in whole))
    if rank:
        tensors += adapter_tensors(model, lora)
    c = model.config
    per_layer = layer_configs(c)
    kv = [(_kv_heads(layer), getattr(layer, "head_dim", None) or c.hidden_size // layer.num_attention_heads)
          for layer in per_layer]
    if len(kv) == 1:  # one config for every layer
        kv *= c.num_hidden_layers
    first = per_layer[0]
    intermediate = getattr(first, "intermediate_size", None) or (moe.moe_intermediate if moe else 0)
    return ModelShape(name=name, tensors=tuple(tensors), hidden=c.hidden_size, intermediate=intermediate,
                      layers=c.num_hidden_layers, heads=first.num_attention_heads, kv_heads=kv[0][0],
                      head_dim=kv[0][1], vocab=c.vocab_size,
                      tied=bool(getattr(c, "tie_word_embeddings",
                                        False)), max_positions=getattr(c, "max_position_embeddings", None),
                      model_type=c.model_type, layer_heads=tuple(layer_heads(c)), layer_kv=tuple(kv), moe=moe,
                      lora_rank=rank)


def _unit(name: str) -> str:
    match = _LAYER.match(name)
    return f"layers.{match.group(1)}" if match else "root"


def adapter_tensors(model: torch.nn.Module, lora: LoraConfig) -> list[Tensor]:
    """The LoRA adapters the trainer puts on `model` (models/lora.py `adapter_layout`: the same modules):
    per adapted nn.Linear [out, in], peft's lora_A [r, in] and lora_B [out, r], in that module's block."""
    tensors = []
    for module_name in adapter_layout(model, lora).adapted:
        linear = model.get_submodule(module_name)
        unit = _unit(module_name)
        tensors += [Tensor(f"{module_name}.lora_A.{ADAPTER}.weight", (lora.rank, linear.in_features), unit,
                           adapter=True),
                    Tensor(f"{module_name}.lora_B.{ADAPTER}.weight", (linear.out_features, lora.rank), unit,
                           adapter=True)]
    return tensors


def _kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


__all__ = ["ModelShape", "MoeShape", "Tensor", "adapter_tensors", "build_meta_model", "model_shape"]

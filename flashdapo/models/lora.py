"""LoRA adapters on the policy, through peft (the library whose adapters transformers and vLLM load).

The choices, before the code:

- **In place, not wrapped.** `peft.inject_adapter_in_model` replaces each target `nn.Linear` by peft's
  `lora.Linear` (the frozen `base_layer` plus `lora_A`, `lora_B`) inside the HF model itself, so the policy
  keeps its `hf.model`, its decoder blocks (FSDP2's units), its LM head (read by the fused kernels unchanged)
  and its sampling forward: the torch engine samples the adapted policy as it is.
- **Frozen base in its compute dtype.** Every parameter but the adapters has requires_grad False: no
  gradients, no optimizer states and no checkpoint entries for it. The adapters are float32 (their master
  weights; FSDP2's mixed precision casts them for bf16 compute), the base is loaded in the compute dtype.
- **Targets** come from the family (models/hf.py `adapter_modules`) or `lora.target_modules`, and are only
  `nn.Linear` modules inside the decoder blocks: never the embeddings, the LM head, the routers, or the routed
  experts transformers holds fused as 3-D parameters. A name that matches nothing is refused in one line.
- **Norms, whole.** `lora.train_norms` trains the normalization weights beside the adapters (all of them,
  the final one, or none): with the LM head and the final norm frozen the policy cannot sharpen past the
  base (docs/lora.md). They are float32 like the adapters and go wherever the adapters go (optimizer,
  checkpoint, push, export), under their plain names; `AdapterLayout.trains` says which tensors those are.
- **Names.** Held: `model.layers.0.self_attn.q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`.
  Written as a PEFT adapter (`adapter_model.safetensors`): `base_model.model.model.layers.0.self_attn.q_proj.
  lora_A.weight`, the names `PeftModel.from_pretrained` and vLLM's LoRA loader read. Merged (the HF export,
  `merged_stream`): `...q_proj.weight` = W + alpha/r * B @ A, computed in float32 (or wider).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ConfigError, LoraConfig
from ..errors import FlashdapoError
from .hf import FAMILIES, decoder_layers, group_modules
from .weights import hf_name

ADAPTER = "default"
"""peft's adapter name; the only adapter a policy holds."""
_ADAPTER_PART = re.compile(r"\.lora_(A|B)\." + ADAPTER + r"\.")
_BASE_PART = ".base_layer."


@dataclass(frozen=True)
class AdapterLayout:
    """What the adapters are: the peft config they were made with and the modules they adapt."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    """Short module names (q_proj, ...), as peft matches them."""
    adapted: tuple[str, ...]
    """Full names of the adapted modules, in module order."""
    norms: tuple[str, ...] = ()
    """Full names of the normalization parameters trained whole beside the adapters (lora.train_norms), in
    module order: `model.norm.weight`, ..."""

    def trains(self, name: str) -> bool:
        """Whether the tensor `name` (held, under any wrapper or owner prefix: `hf.model.norm.weight` in the
        policy's state dict) trains: an adapter's or a trained norm's."""
        if is_adapter(name):
            return True
        name = hf_name(name)
        return any(name == norm or name.endswith("." + norm) for norm in self.norms)

    @property
    def norm_modules(self) -> tuple[str, ...]:
        """The modules whose parameters `norms` holds (PEFT's `modules_to_save`)."""
        return tuple(dict.fromkeys(name.rsplit(".", 1)[0] for name in self.norms))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, base_model: str = ""):
        """peft's LoraConfig of these adapters (`base_model`: the path adapter_config.json names)."""
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                              target_modules=list(self.target_modules), bias="none",
                              modules_to_save=list(self.norm_modules) or None,
                              base_model_name_or_path=base_model or None, task_type="CAUSAL_LM")


def adapter_layout(hf: nn.Module, cfg: LoraConfig) -> AdapterLayout:
    """The modules `cfg` adapts on `hf` (its family's defaults unless cfg.target_modules names them);
    ConfigError when a named module is not a linear layer of a decoder block, or nothing matches."""
    family = FAMILIES[hf.config.model_type]
    wanted = tuple(cfg.target_modules) or family.adapter_modules
    names = {id(module): name for name, module in hf.named_modules()}
    adapted, found = [], set()
    for block_name in (names[id(layer)] for layer in decoder_layers(hf)):
        for name, module in hf.get_submodule(block_name).named_modules():
            short = name.rsplit(".", 1)[-1]
            if short in wanted and isinstance(module, nn.Linear):
                adapted.append(f"{block_name}.{name}")
                found.add(short)
    missing = [m for m in cfg.target_modules if m not in found]
    if missing or not adapted:
        raise ConfigError(
            f"lora.target_modules: {', '.join(missing or wanted)} is no linear layer of a "
            f"{hf.config.model_type} decoder block; its linear layers are "
            f"{', '.join(_linear_names(hf)) or 'none'}")
    return AdapterLayout(cfg.rank, cfg.alpha, cfg.dropout, tuple(sorted(found)), tuple(adapted),
                         _trained_norms(hf, cfg.train_norms))


def _trained_norms(hf: nn.Module, which: str) -> tuple[str, ...]:
    """The parameter names of the normalization layers lora.train_norms `which` trains: every module whose
    class is a norm (RMSNorm, LayerNorm and their family variants) for "all", the one before the LM head for
    "final"."""
    if which == "none":
        return ()
    if which == "final":
        final = group_modules(hf, hf.config.model_type)[-1][1]
        modules = [(name, m) for name, m in hf.named_modules() if m is final]
    else:
        modules = [(name, m) for name, m in hf.named_modules() if "Norm" in type(m).__name__]
    return tuple(hf_name(f"{name}.{p}") for name, m in modules for p, _ in m.named_parameters(recurse=False))


def _linear_names(hf: nn.Module) -> list[str]:
    layer = decoder_layers(hf)[0]
    return sorted({name.rsplit(".", 1)[-1] for name, m in layer.named_modules() if isinstance(m, nn.Linear)})


def add_adapters(hf: nn.Module, cfg: LoraConfig, seed: int) -> AdapterLayout:
    """Put `cfg`'s adapters on `hf` in place (peft), freeze everything else but the norms lora.train_norms
    names; the layout. Adapters and trained norms are float32
    (master weights) over a half-precision base. `seed` draws lora_A (B starts at zero) the same on every
    rank, whatever the global generator holds. On the meta device they are meta too (the load fills them)."""
    from peft import inject_adapter_in_model

    layout = adapter_layout(hf, cfg)
    peft_config = layout.peft_config()
    peft_config.target_modules = list(layout.adapted)  # exactly these modules, by full name
    peft_config.modules_to_save = None  # the norms stay plain modules: trained in place, not wrapped
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config, hf, adapter_name=ADAPTER)
    # The norms' base values, for an export of the base (sync WeightSource.base: the toy's, which exists only
    # in memory); none on the meta device, where the base is model.path's checkpoint.
    hf.adapter_base_norms = {hf_name(name): param.detach().clone() for name, param in hf.named_parameters()
                             if hf_name(name) in layout.norms and not param.is_meta}
    for name, param in hf.named_parameters():
        trains = layout.trains(name)
        param.requires_grad_(trains)
        if trains and param.dtype in (torch.bfloat16, torch.float16):
            param.data = param.data.float()
    for name in layout.norm_modules:  # a norm's fp32 weight would promote its output out of the base's dtype
        hf.get_submodule(name).register_forward_hook(_in_input_dtype)
    for name, module in list(hf.named_modules()):  # peft's nn.Dropout follows the model's train/eval mode
        if name.endswith(f"lora_dropout.{ADAPTER}") and isinstance(module, nn.Dropout):
            hf.get_submodule(name.rsplit(".", 1)[0])[ADAPTER] = UpdateDropout(module.p)
    hf.adapter_layout = layout
    return layout


def _in_input_dtype(_module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """A trained norm's output in its input's dtype (bf16 over a bf16 base outside FSDP2's mixed precision,
    which casts the weight itself; a no-op in fp32)."""
    return out.to(args[0].dtype) if args and isinstance(args[0], torch.Tensor) else out


class UpdateDropout(nn.Module):
    """An adapter's input dropout that is on only inside `adapter_dropout` (the update's forwards), whatever
    the model's train/eval mode: sampling, the old log-probs and the push check never drop."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, self.p, training=True) if self.on else x


def _dropouts(hf: nn.Module) -> list[UpdateDropout]:
    return [m for m in hf.modules() if isinstance(m, UpdateDropout)]


@contextmanager
def adapter_dropout(hf: nn.Module) -> Iterator[None]:
    """The adapters' dropout (lora.dropout > 0) on for the update's forwards, off again after: sampling, the
    old log-probs and the push check compute the policy without it. A no-op without adapters or dropout."""
    dropouts = _dropouts(hf)
    for dropout in dropouts:
        dropout.on = True
    try:
        yield
    finally:
        for dropout in dropouts:
            dropout.on = False


def layout_of(hf: nn.Module) -> AdapterLayout | None:
    """The adapters `hf` carries (add_adapters), None for a model trained whole."""
    return getattr(hf, "adapter_layout", None)


def is_adapter(name: str) -> bool:
    """Whether a parameter name (held, any wrapper prefixes) is an adapter's."""
    return bool(_ADAPTER_PART.search(name))


def peft_name(name: str) -> str:
    """A trained tensor's name as a PEFT adapter file holds it: `base_model.model.<module>.lora_A.weight` for
    an adapter's, `base_model.model.model.norm.weight` for a norm trained whole (PEFT's modules_to_save)."""
    return "base_model.model." + _ADAPTER_PART.sub(lambda m: f".lora_{m.group(1)}.", hf_name(name))


def trained(hf: nn.Module) -> Callable[[str], bool]:
    """The names of the tensors that train on an adapted `hf` (adapters and trained norms), as a predicate
    for `iter_full_state_dict(only=...)`: what a checkpoint, a push and an adapter export carry."""
    layout = layout_of(hf)
    if layout is None:
        raise FlashdapoError("trained(): the model carries no adapters")
    return layout.trains


def base_name(name: str) -> str:
    """A held name as the plain model's: `...q_proj.base_layer.weight` -> `...q_proj.weight`."""
    return name.replace(_BASE_PART, ".")


def merged_stream(named: Iterator[tuple[str, torch.Tensor]],
                  layout: AdapterLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """A full-tensor stream of an adapted model as the plain model's: `...base_layer.weight` held until its
    module's A and B arrive, then yielded as `...weight` = W + alpha/r * B @ A (float32 arithmetic, the base's
    dtype out); other base tensors renamed, adapters consumed."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        adapter = _ADAPTER_PART.search(name)
        if name.endswith(".base_layer.weight"):
            module, part = name.removesuffix(".base_layer.weight"), "W"
        elif adapter is not None:
            module, part = name[:adapter.start()], adapter.group(1)
        else:
            yield base_name(name), tensor
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor  # never written to: the merge below makes new tensors
        if len(parts) == 3:
            del pending[module]
            w = parts["W"]
            wide = torch.promote_types(w.dtype, torch.float32)
            delta = (parts["B"].to(wide) @ parts["A"].to(wide)) * layout.scaling
            yield f"{module}.weight", (w.to(wide) + delta).to(w.dtype)
    if pending:
        raise FlashdapoError(f"adapters without their base weight (or the reverse): {sorted(pending)[:3]}")


__all__ = ["ADAPTER", "AdapterLayout", "UpdateDropout", "adapter_dropout", "adapter_layout", "add_adapters",
           "base_name", "is_adapter", "layout_of", "merged_stream", "peft_name", "trained"]

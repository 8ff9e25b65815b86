"""A mixture-of-experts model's expert tensors in their two layouts, and the mapping between them.

transformers 5 holds the routed experts of a MoE layer fused, one tensor per projection for all experts
(`model.layers.N.mlp.experts.gate_up_proj` [E, 2I, H] and `...experts.down_proj` [E, H, I]), and converts
per-expert checkpoints (`...mlp.experts.<e>.{gate,up,down}_proj.weight`, [I, H] / [I, H] / [H, I], what the
Hub's Qwen3-MoE and DeepSeek-V3 checkpoints hold) into them on load: its conversion mapping for `qwen2_moe`,
which `qwen3_moe`, `deepseek_v3` and most MoE families share (transformers/conversion_mapping.py), stacks each
projection over the experts (`MergeModulelist(dim=0)`) and concatenates gate and up along dim 1
(`Concatenate(dim=1)`): gate_up_proj[e] = cat(gate_proj_e, up_proj_e), gate rows first. The mapping here is
that conversion and its exact inverse (views and stacks, no arithmetic), by name and by value, on a state dict
or on a stream of (name, tensor) such as `models.weights.iter_full_state_dict` yields:

- `split_experts` turns fused tensors into per-expert ones: what vLLM's MoE loaders take (every family maps
  per-expert names; only some take the fused ones) and what a per-expert checkpoint holds. Each per-expert
  tensor is a view of the fused one (no copy).
- `fuse_experts` turns per-expert tensors back into fused ones, buffering one layer's experts at a time.
- `checkpoint_expert_layout` says which layout a model directory's safetensors use, from the tensor names
  alone (the index json or the files' headers), so that the HF export can write the layout its source had.

Not every family's fused tensors are these: GPT-OSS's `mlp.experts.gate_up_proj` is [E, H, 2I] with gate and
up interleaved, and its checkpoints are fused too. So splitting is for the families whose transformers
conversion is the one above (the registry says which: `Family.engine_experts` "per_expert", models/hf.py);
their fused tensors are never on disk in the Hub's checkpoints, and vLLM's loaders for them all take
per-expert names.

Shared experts (Qwen2-MoE's `mlp.shared_expert`, DeepSeek-V3's `mlp.shared_experts`) are plain MLPs, not
fused, and pass through unchanged; so do the router (`mlp.gate`) and every other tensor.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

__all__ = ["FUSED", "PER_EXPERT", "checkpoint_expert_layout", "checkpoint_tensor_names", "fuse_experts",
           "fused_expert_name", "per_expert_name", "split_experts", "split_fused"]

FUSED, PER_EXPERT = "fused", "per_expert"
"""The two layouts of a checkpoint's routed experts (`checkpoint_expert_layout`)."""

_FUSED_NAME = re.compile(r"^(?P<experts>(?:.*\.)?mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PER_EXPERT_NAME = re.compile(r"^(?P<experts>(?:.*\.)?mlp\.experts)\.(?P<index>\d+)\."
                              r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_OF = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def per_expert_name(name: str) -> tuple[str, int, str] | None:
    """(experts module path, expert index, projection) of a per-expert tensor name
    (`model.layers.3.mlp.experts.7.up_proj.weight` -> ('model.layers.3.mlp.experts', 7, 'up_proj')), else
    None."""
    match = _PER_EXPERT_NAME.match(name)
    return (match["experts"], int(match["index"]), match["proj"]) if match else None


def fused_expert_name(name: str) -> tuple[str, str] | None:
    """(experts module path, projection) of a fused expert tensor name
    (`model.layers.3.mlp.experts.gate_up_proj` -> ('model.layers.3.mlp.experts', 'gate_up_proj')), else
    None."""
    match = _FUSED_NAME.match(name)
    return (match["experts"], match["proj"]) if match else None


def split_fused(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The per-expert tensors of one fused expert tensor, expert by expert (gate before up), as views of it.
    ValueError when `name` is not a fused expert name or the shape is not [E, 2I, H] / [E, H, I]."""
    parsed = fused_expert_name(name)
    if parsed is None or tensor.dim() != 3:
        raise ValueError(f"{name!r} {tuple(tensor.shape)}: expected a fused expert tensor "
                         "'...mlp.experts.gate_up_proj' [E, 2I, H] or '...mlp.experts.down_proj' [E, H, I]")
    experts, proj = parsed
    if proj == "down_proj":
        return [(f"{experts}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    if tensor.shape[1] % 2:
        raise ValueError(
            f"{name!r} {tuple(tensor.shape)}: gate_up_proj's dim 1 (2 x intermediate) must be even")
    half = tensor.shape[1] // 2
    out = []
    for e in range(tensor.shape[0]):
        out += [(f"{experts}.{e}.gate_proj.weight", tensor[e, :half]),
                (f"{experts}.{e}.up_proj.weight", tensor[e, half:])]
    return out


def split_experts(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with every fused expert tensor replaced by its per-expert tensors (views, in place of it);
    every other tensor unchanged, in order. Accepts a state dict's `.items()` or any (name, tensor) stream."""
    for name, tensor in named_tensors:
        if fused_expert_name(name) is None:
            yield name, tensor
        else:
            yield from split_fused(name, tensor)


class _Pending:
    """One experts module's per-expert tensors, buffered until all its experts are in."""

    def __init__(self, experts: str):
        self.experts, self.tensors = experts, {}

    def add(self, index: int, proj: str, tensor: torch.Tensor) -> None:
        if (index, proj) in self.tensors:
            raise ValueError(f"{self.experts}.{index}.{proj}.weight appears twice in the stream")
        self.tensors[(index, proj)] = tensor

    def complete(self, num_experts: int | None) -> bool:
        """All `num_experts` experts' three tensors are in (never, when the count is not known)."""
        return num_experts is not None and len(self.tensors) == 3 * num_experts

    def fused(self) -> list[tuple[str, torch.Tensor]]:
        count = 1 + max(index for index, _ in self.tensors)
        missing = [f"{self.experts}.{e}.{p}.weight" for e in range(count) for p in _FUSED_OF
                   if (e, p) not in self.tensors]
        if missing:
            raise ValueError(
                f"per-expert tensors missing for {self.experts} ({count} experts): {missing[:6]}")
        gate_up = torch.stack([torch.cat([self.tensors[(e, "gate_proj")], self.tensors[(e, "up_proj")]])
                               for e in range(count)])
        down = torch.stack([self.tensors[(e, "down_proj")] for e in range(count)])
        return [(f"{self.experts}.gate_up_proj", gate_up), (f"{self.experts}.down_proj", down)]


def fuse_experts(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 num_experts: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with each experts module's per-expert tensors replaced by the two fused tensors
    (gate_up_proj then down_proj, where its last expert tensor was); every other tensor unchanged, in order.
    With `num_experts` a module is emitted as soon as its experts are complete (modules may interleave), else
    when the stream moves past its tensors. ValueError on a missing or repeated expert tensor."""
    pending: dict[str, _Pending] = {}
    for name, tensor in named_tensors:
        parsed = per_expert_name(name)
        if num_experts is None:  # a module ends where the stream leaves it
            for experts in [e for e in pending if parsed is None or parsed[0] != e]:
                yield from pending.pop(experts).fused()
        if parsed is None:
            yield name, tensor
            continue
        experts, index, proj = parsed
        module = pending.setdefault(experts, _Pending(experts))
        module.add(index, proj, tensor)
        if module.complete(num_experts):
            yield from pending.pop(experts).fused()
    for module in pending.values():
        yield from module.fused()


def _safetensors_names(path: Path) -> list[str]:
    """The tensor names in one safetensors file, from its header alone (8-byte length, then JSON)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return [name for name in header if name != "__metadata__"]


def checkpoint_tensor_names(model_dir: str | Path) -> list[str]:
    """Every tensor name of a model directory's safetensors checkpoint, read from
    `model.safetensors.index.json` when there is one, else from the headers of its `*.safetensors` files (no
    tensor is loaded)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    return [name for path in sorted(root.glob("*.safetensors")) for name in _safetensors_names(path)]


def checkpoint_expert_layout(model_dir: str | Path) -> str | None:
    """FUSED or PER_EXPERT: how the routed experts of the safetensors checkpoint in `model_dir` are stored,
    from its tensor names; None when it holds no expert tensor (a dense model, or no safetensors at all)."""
    fused = per_expert = False
    for name in checkpoint_tensor_names(model_dir):
        fused = fused or fused_expert_name(name) is not None
        per_expert = per_expert or per_expert_name(name) is not None
    if fused and per_expert:
        raise ValueError(
            f"{model_dir}: the checkpoint holds both fused ('...mlp.experts.gate_up_proj') and "
            "per-expert ('...mlp.experts.<e>.gate_proj.weight') expert tensors; expected one layout")
    return FUSED if fused else PER_EXPERT if per_expert else None

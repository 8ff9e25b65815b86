"""A PEFT adapter directory as a model (`flashdapo eval --model runs/x/export` of a LoRA run).

A directory holding `adapter_config.json` is an adapter: its weights (`adapter_model.safetensors`) are
deltas over the base model its `base_model_name_or_path` names (a LoRA run's export names model.path, or
the toy's `export-base/`). `read_adapter` checks it before anything loads: the config readable, a LoRA
adapter with its weights, the base an HF checkpoint directory (model_dir.check_model_dir), each failure one
line naming adapter_config.json and its field. `merge_adapter` applies it to the loaded base with peft
(`PeftModel.from_pretrained`, then `merge_and_unload`: every adapted weight W + alpha/r B A), so the torch
engine samples the adapted policy from a plain model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from .model_dir import ModelDirError, check_model_dir

ADAPTER_CONFIG = "adapter_config.json"
BASE_FIELD = "base_model_name_or_path"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class AdapterDir:
    """A checked adapter directory and the base it applies to."""

    path: str
    base: str
    """The base model's directory (from adapter_config.json, or the override `read_adapter` was given)."""
    config: dict[str, Any]
    """adapter_config.json as read."""

    @property
    def rank(self) -> int:
        """The largest LoRA rank (`r`, or a larger one in `rank_pattern`)."""
        pattern = self.config.get("rank_pattern") or {}
        return max([int(self.config.get("r", 8)), *(int(r) for r in pattern.values())])


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` is a directory holding adapter_config.json."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter(path: str | Path, field: str = "--model", base: str = "",
                 base_option: str = "--base") -> AdapterDir:
    """The adapter at `path` (named `field` in messages) and its base: `base` where given (the override option
    `base_option`), else the directory adapter_config.json names. ModelDirError, one line, where the config is
    unreadable, the adapter no LoRA or without weights, or the base no loadable HF checkpoint directory."""
    root = Path(path)
    config_file = root / ADAPTER_CONFIG
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except PermissionError as err:
        raise ModelDirError(f"{config_file}: permission denied: the user running flashdapo may not read "
                            "it") from err
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise ModelDirError(f"{config_file}: not a readable adapter config ({err}); re-export the "
                            "adapter") from err
    if not isinstance(config, dict):
        raise ModelDirError(f"{config_file}: not a JSON object; re-export the adapter")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ModelDirError(f"{config_file}: peft_type {kind!r}: flashdapo evaluates LoRA adapters only; "
                            "merge it into its base and give that directory as " + field)
    if not any((root / name).is_file() for name in ADAPTER_WEIGHTS):
        raise ModelDirError(f"{field}={root}: an adapter directory ({ADAPTER_CONFIG}) without its weights "
                            f"({' or '.join(ADAPTER_WEIGHTS)}); copy the whole export")
    if base:
        check_model_dir(base, base_option)
        return AdapterDir(str(root), str(base), config)
    named = config.get(BASE_FIELD)
    if not isinstance(named, str) or not named or not Path(named).is_dir():
        shown = repr(named) if isinstance(named, str) and named else "missing"
        raise ModelDirError(
            f"{config_file}: {BASE_FIELD} {shown} is not a directory; it must name the base model the "
            f"adapter was trained on (an HF checkpoint directory): give it with {base_option} DIR")
    check_model_dir(named, f"{config_file} {BASE_FIELD}")
    return AdapterDir(str(root), named, config)


def merge_adapter(hf: nn.Module, adapter: str | Path) -> nn.Module:
    """`hf` (the adapter's base, loaded) with the adapter at `adapter` merged in (peft's `merge_and_unload`):
    the plain model of the adapted policy. ModelDirError, one line, where the adapter does not fit `hf`
    (modules it adapts that `hf` lacks, tensors of other shapes)."""
    from peft import PeftModel

    try:
        adapted = PeftModel.from_pretrained(hf, str(adapter), is_trainable=False)
    except (ValueError, KeyError, RuntimeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ModelDirError(f"{adapter}: the adapter does not fit its base model ({first[:300]}); give the "
                            "base it was trained on") from err
    return adapted.merge_and_unload()


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "AdapterDir", "BASE_FIELD", "is_adapter_dir", "merge_adapter",
           "read_adapter"]

"""A LoRA adapter directory as `flashdapo eval` / `generate`'s --model (docs/eval.md, "A LoRA adapter").

The choices, before the code:

- **Recognised by its adapter_config.json** (models/adapter_dir.py `read_adapter`): the base it names
  (`base_model_name_or_path`, or `--base DIR`) is the model every check reads (config.json, tokenizer, token
  budget, what the engine builds) and the engines load; a base that is no directory is one line naming
  adapter_config.json and the field. `--base` with a plain model directory is refused.
- **torch engine: merged.** The base is loaded as a plain model would be and the adapter merged into it with
  peft (`merge_and_unload`: W + alpha/r B A), so sampling is the adapted policy's, drawn as from the merged
  export with the same seed; with `--fsdp` rank 0 merges before the broadcast (models/loading.py).
- **vLLM: served unmerged.** vLLM starts on the base with `enable_lora` (one adapter slot, the smallest
  `max_lora_rank` it accepts that holds the adapter's rank) and every generate names the adapter directory
  with a `LoRARequest`. rollout/'s VLLMEngine is not changed for it: it is handed a stand-in of the `vllm`
  module whose `LLM` adds both (`serving_adapter`). A rank past vLLM's largest, or a DoRA adapter (no vLLM
  LoRA layer takes it), is refused before anything loads. Norms trained whole (`modules_to_save`, a
  LoRA run's `lora.train_norms`) are no adapter vLLM takes: the LoRARequest names a copy of the directory
  without them, and they are loaded into the engine's base after it starts (sync/vllm.py `push_norms`).
"""

from __future__ import annotations

import atexit
import importlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError, engine_spec
from ..models.adapter_dir import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    BASE_FIELD,
    AdapterDir,
    is_adapter_dir,
    read_adapter,
)
from ..models.model_dir import check_model_dir
from ..sync.vllm import max_lora_rank, push_norms, vllm_lora_ranks

LORA_NAME = "flashdapo-eval"
LORA_ID = 1


@dataclass(frozen=True)
class ModelSource:
    """What --model loads: a model directory, or an adapter's base with the adapter."""

    model: str
    """The directory whose config.json, tokenizer and weights load (--model, or the adapter's base)."""
    field: str
    """How messages name it (`--model`, `--base`, or the adapter's adapter_config.json field)."""
    adapter: AdapterDir | None = None

    def where(self) -> str:
        return f"{self.field}={self.model}"


def model_source(args: Any) -> ModelSource:
    """--model (and --base) checked: a plain HF model directory, or an adapter directory with its base
    (module docstring); one line (ModelDirError, ConfigError) for what cannot load."""
    base = getattr(args, "base", "") or ""
    if not is_adapter_dir(args.model):
        check_model_dir(args.model, "--model")
        return ModelSource(args.model, "--model")
    adapter = read_adapter(args.model, "--model", base, "--base")
    field = "--base" if base else f"{Path(args.model) / ADAPTER_CONFIG} {BASE_FIELD}"
    if engine_spec(args.engine).own_weights:
        check_vllm_adapter(adapter, args.engine)
    return ModelSource(adapter.base, field, adapter)


def check_vllm_adapter(adapter: AdapterDir, engine: str) -> None:
    """ConfigError, one line, for an adapter vLLM cannot serve: a rank past its largest max_lora_rank,
    DoRA."""
    config_file = Path(adapter.path) / ADAPTER_CONFIG
    if max_lora_rank(adapter.rank) is None:
        raise ConfigError(f"{config_file}: rank {adapter.rank} is past vLLM's largest max_lora_rank "
                          f"({max(vllm_lora_ranks())}); evaluate it with --engine torch (which merges it)")
    if adapter.config.get("use_dora"):
        raise ConfigError(f"{config_file}: use_dora: vLLM serves no DoRA adapter; evaluate it with --engine "
                          f"torch (which merges it), not --engine {engine}")


def serving_adapter(vllm: Any, adapter: AdapterDir) -> Any:
    """A stand-in of the `vllm` module whose `LLM` starts with the adapter enabled and names it in every
    generate (module docstring); everything else is `vllm`'s."""
    return _AdapterVLLM(vllm, adapter)


class _AdapterVLLM:
    def __init__(self, vllm: Any, adapter: AdapterDir) -> None:
        self._vllm = vllm
        self.__name__ = getattr(vllm, "__name__", "vllm")
        request_class = getattr(getattr(getattr(vllm, "lora", None), "request", None), "LoRARequest", None)
        if request_class is None:
            request_class = importlib.import_module(f"{self.__name__}.lora.request").LoRARequest
        served, norms = _without_norms(adapter)
        request = request_class(LORA_NAME, LORA_ID, served)
        llm_class, slot = vllm.LLM, max_lora_rank(adapter.rank)

        def llm(model: str, **kwargs: Any) -> AdapterLLM:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=slot)
            engine = llm_class(model=model, **kwargs)
            if norms:
                push_norms(engine, norms)
            return AdapterLLM(engine, request)

        self.LLM = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vllm, name)


def _without_norms(adapter: AdapterDir) -> tuple[str, dict[str, Any]]:
    """The directory vLLM's LoRARequest names, and the tensors trained whole (`modules_to_save`: the norms,
    plain HF names) it cannot take: the adapter itself when it has none, else a temporary copy without them
    (removed at exit)."""
    root = Path(adapter.path).resolve()
    if not adapter.config.get("modules_to_save"):
        return str(root), {}
    from safetensors.torch import load_file, save_file

    if not (root / ADAPTER_WEIGHTS[0]).is_file():
        raise ConfigError(f"{root}: an adapter with modules_to_save is served by vLLM from "
                          f"{ADAPTER_WEIGHTS[0]} only; evaluate it with --engine torch (which merges it)")
    tensors = load_file(str(root / ADAPTER_WEIGHTS[0]))
    lora = {name: t for name, t in tensors.items() if ".lora_" in name}
    norms = {name.removeprefix("base_model.model."): t for name, t in tensors.items() if ".lora_" not in name}
    copy = Path(tempfile.mkdtemp(prefix="flashdapo-adapter-"))
    atexit.register(shutil.rmtree, copy, ignore_errors=True)
    save_file(lora, str(copy / ADAPTER_WEIGHTS[0]), metadata={"format": "pt"})
    config = {**adapter.config, "modules_to_save": None}
    (copy / ADAPTER_CONFIG).write_text(json.dumps(config), encoding="utf-8")
    return str(copy), norms


class AdapterLLM:
    """A `vllm.LLM` started with enable_lora whose generate names `request` (the adapter directory)."""

    def __init__(self, llm: Any, request: Any) -> None:
        self.llm = llm
        self.lora_request = request

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("lora_request", self.lora_request)
        return self.llm.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)


def adapter_line(source: ModelSource, engine: str) -> str:
    """The start-up line of an adapter evaluation: the adapter, its rank, the base, how the engine applies
    it."""
    adapter = source.adapter
    how = ("served by vLLM unmerged (enable_lora, a LoRARequest per generate)"
           if engine_spec(engine).own_weights else "merged into the base with peft")
    return f"LoRA adapter {adapter.path} (rank {adapter.rank}) over the base {adapter.base}, {how}"


__all__ = ["AdapterLLM", "ModelSource", "adapter_line", "check_vllm_adapter", "model_source",
           "serving_adapter"]

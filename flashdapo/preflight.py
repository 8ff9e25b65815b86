"""Checks before any work: the launch (devices, optional packages, batch sizes vs ranks) and the model and
tokenizer (from config.json and the tokenizer files, before the weights load). Used by `flashdapo train`
(trainer/setup.py) and `flashdapo eval` (eval/command.py).

Each failure is one line naming the field or file and what to do: a launch setting is a `ConfigError`
(`flashdapo: config error: ...`), a model directory that cannot serve the run a `ModelDirError`. What the
checks find but accept (a tokenizer without a chat template, which then gets the plain template) comes
back as notes for the log, said once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config, ConfigError, engine_spec
from .models.hf import (
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    attention_refusal,
    multimodal_refusal,
    resolved_attention,
)
from .models.model_dir import ModelDirError
from .models.moe.replay import check_routing_replay
from .models.moe.router import check_router_aux_coef
from .rollout.engine_models import check_engine_lora, check_engine_model
from .tokenizer import eos_token_ids, load_tokenizer

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n{% endfor "
    "%}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")
"""For a tokenizer without a chat template: 'User: <prompt>\\n\\nAssistant:' (a base model's plain format)."""

VLLM_HINT = "pip install 'flashdapo[gpu]' (vLLM), or use 'torch'"


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------------
# The launch


def check_launch(cfg: Config, world_size: int | None = None) -> None:
    """Refuse, before the process group starts, a training config this machine or launch cannot run: what
    this machine lacks (`check_machine`) and what the launch's ranks cannot share (`check_layout`).
    `world_size`: torchrun's WORLD_SIZE by default."""
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    check_machine(cfg)
    check_layout(cfg, world_size)
    check_rollout_model(cfg)
    check_model_attention(cfg)


def check_model_attention(cfg: Config) -> None:
    """The model settings model.path's family cannot run (`check_model_settings`), from its config.json,
    before any weights load. An absent or unreadable config.json is left to model_dir.check_model_dir."""
    config = _config_json(cfg.model.path)
    if config is not None and config.get("model_type") in SUPPORTED_MODEL_TYPES:
        check_model_settings(cfg, config, f"model.path={cfg.model.path}")


def check_model_settings(cfg: Config, config: dict[str, Any], where: str) -> None:
    """Refuse, in one line, a model setting `config` (a config.json of a registered family) cannot honour: an
    attention implementation its transformers modeling cannot run right (models/hf.py ATTENTION_REFUSED; only
    an explicit choice: `auto` picks one that can), a router-loss coefficient where no router loss applies (a
    dense model, DeepSeek-V3's bias-balanced routers), routing replay without softmax top-k routers. `train`
    and `plan` both run it: a plan passes exactly what the launch accepts."""
    model_type = config["model_type"]
    reason = attention_refusal(config, cfg.model.attn_implementation)
    if reason is not None:
        raise ConfigError(
            f"model.attn_implementation={cfg.model.attn_implementation}: {model_type} at {where}: "
            f"{reason}")
    check_router_aux_coef(cfg.model.router_aux_loss_coef, config)
    check_routing_replay(cfg.algorithm.routing_replay, config)


def check_machine(cfg: Config) -> None:
    """What this machine must have for `cfg`: CUDA or a GPU-only kernel without a GPU, an optional package
    that is not installed."""
    check_device(cfg.trainer.device, "trainer.device")
    on_gpu = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and _cuda_available())
    check_kernels(cfg, on_gpu)
    if cfg.trainer.fsdp_cpu_offload and not on_gpu:
        raise ConfigError(
            "trainer.fsdp_cpu_offload: true offloads a GPU's parameters to host memory, and this run "
            "has no GPU (its parameters are in host memory already); set it false")
    check_engine(cfg.rollout.engine, "rollout.engine")
    if cfg.logging.wandb and not installed("wandb"):
        raise ConfigError("logging.wandb: true needs the wandb package (pip install wandb); or set it false")
    if cfg.logging.tensorboard and not installed("tensorboard"):
        raise ConfigError(
            "logging.tensorboard: true needs the tensorboard package (pip install tensorboard); "
            "or set it false")


def check_layout(cfg: Config, world_size: int) -> None:
    """What a launch of `world_size` ranks needs of `cfg`, on any machine (`flashdapo plan` runs this for a
    cluster it is not on): batch sizes the ranks and data-parallel slots can share, a tensor-parallel size
    the ranks divide into, profiled ranks that exist and train (not split placement's rollout ranks), data for
    a model of one's own."""
    if cfg.rollout.placement == "split":
        check_split_layout(cfg, world_size)
    else:
        check_batch_layout(cfg, world_size)
    if (engine_spec(cfg.rollout.engine).tensor_parallel and cfg.rollout.placement == "colocated"
            and world_size % cfg.rollout.tensor_parallel_size):
        raise ConfigError(
            f"rollout.tensor_parallel_size: {cfg.rollout.tensor_parallel_size} does not divide the "
            f"world size {world_size}; use a divisor of it")
    outside = [r for r in cfg.profile.ranks if r >= world_size]
    if outside:
        raise ConfigError(f"profile.ranks: rank {outside[0]} is not in a launch of {world_size} ranks (0.."
                          f"{world_size - 1}); leave it empty to profile every rank")
    trainers = world_size - cfg.rollout.rollout_ranks if cfg.rollout.placement == "split" else world_size
    generating = [r for r in cfg.profile.ranks if r >= trainers]
    if generating:  # split placement: the last rollout_ranks ranks only generate, and profile nothing
        raise ConfigError(
            f"profile.ranks: rank {generating[0]} is a rollout rank under rollout.placement=split "
            f"(ranks {trainers}..{world_size - 1} generate, and only training steps are profiled); "
            f"name trainer ranks 0..{trainers - 1}, or leave it empty to profile every trainer rank")
    if cfg.model.path and not cfg.data.train_files:
        raise ConfigError(
            f"data.train_files: empty with model.path={cfg.model.path}; the built-in toy task is for "
            "the toy model: give --data.train-files FILE [FILE ...] (.parquet or .jsonl)")


def check_split_layout(cfg: Config, world_size: int) -> None:
    """Split placement (rollout.placement=split): the last R = rollout.rollout_ranks ranks run the engines (R
    / tensor_parallel_size of them), the first T = world_size - R train. One line per check: whole engines, a
    trainer rank left, gen_batch shared by the engines, and the batch sizes over the T trainer ranks."""
    rc, tc = cfg.rollout, cfg.trainer
    r, tp = rc.rollout_ranks, rc.tensor_parallel_size if engine_spec(rc.engine).tensor_parallel else 1
    if r % tp:
        raise ConfigError(
            f"rollout.rollout_ranks: {r} is not a multiple of rollout.tensor_parallel_size {tp}: "
            f"an engine spans {tp} ranks; use a multiple of {tp}")
    if r >= world_size:
        raise ConfigError(
            f"rollout.rollout_ranks: {r} of a launch of {world_size} ranks leaves no rank to train; "
            f"use at most {world_size - 1} (or launch more ranks)")
    engines = r // tp
    if tc.gen_batch % engines:
        raise ConfigError(
            f"trainer.gen_batch: {tc.gen_batch} prompts cannot be shared by {engines} engines "
            f"(rollout.rollout_ranks {r} / tensor_parallel_size {tp}); use a multiple of {engines}")
    check_batch_layout(cfg, world_size - r, generating=False)


def check_batch_layout(cfg: Config, world_size: int, generating: bool = True) -> None:
    """Batch sizes the launch's ranks can share. Generation is sharded over every rank (each samples its share
    of gen_batch); training over the data-parallel slots, world_size / sequence_parallel of them (the sp ranks
    of a slot train on the same responses). A step trains a multiple of the slots' number of groups, so
    train_batch must divide by the slots; each mini-batch's responses (not whole groups) are dealt to the
    slots (trainer/collect/dealing.py), so a mini-batch needs only as many responses as there are slots, one
    each."""
    tc = cfg.trainer
    sp = tc.sequence_parallel
    if world_size % sp:
        raise ConfigError(
            f"trainer.sequence_parallel: {sp} does not divide the world size {world_size}; launch a "
            f"multiple of {sp} ranks or use a divisor of {world_size}")
    # the model's num_experts is checked where the model is (moe/expert_parallel.py)
    if world_size % tc.expert_parallel:
        raise ConfigError(
            f"trainer.expert_parallel: {tc.expert_parallel} does not divide the world size {world_size}; "
            f"launch a multiple of {tc.expert_parallel} ranks or use a divisor of {world_size}")
    slots = world_size // sp
    ranks = f"{world_size} ranks" if generating else f"{world_size} trainer ranks"
    layout = f"{ranks} / sequence_parallel {sp}" if sp > 1 else ranks
    if generating and tc.gen_batch % world_size:
        raise ConfigError(
            f"trainer.gen_batch: {tc.gen_batch} prompts cannot be shared by {world_size} generating "
            f"ranks; use a multiple of {world_size} (or launch a divisor of {tc.gen_batch} ranks)")
    fewer_slots = "or fewer slots (more sequence parallelism or fewer ranks)"
    if tc.train_batch % slots:
        raise ConfigError(
            f"trainer.train_batch: {tc.train_batch} prompts cannot be shared by {slots} data-parallel "
            f"slots ({layout}); use a multiple of {slots}, {fewer_slots}")
    n = cfg.rollout.n
    if tc.mini_batch * n < slots:
        raise ConfigError(
            f"trainer.mini_batch: {tc.mini_batch} prompts x rollout.n {n} = {tc.mini_batch * n} "
            f"responses per optimizer step cannot give each of {slots} data-parallel slots ({layout}) "
            f"one; use at least {-(-slots // n)} prompts, {fewer_slots}")


def check_device(device: str, field_name: str) -> None:
    """`cuda` asked for on a machine without one."""
    if device == "cuda" and not _cuda_available():
        raise ConfigError(f"{field_name}: 'cuda' but no CUDA GPU is available (torch.cuda.is_available() is "
                          "False); use 'auto' or 'cpu'")


def check_engine(engine: str, field_name: str) -> None:
    """An engine asked for without its package installed (an import check: vLLM may run on a CPU)."""
    if engine_spec(engine).package is not None and not installed(engine_spec(engine).package):
        raise ConfigError(f"{field_name}: 'vllm' but vLLM is not installed; {VLLM_HINT}")


def check_kernels(cfg: Config, on_gpu: bool) -> None:
    """GPU-only kernels asked for on a CPU: flash-attention, and Triton outside its interpreter."""
    if cfg.model.attn_implementation == "flash_attention_2":
        if not on_gpu:
            raise ConfigError(
                "model.attn_implementation: 'flash_attention_2' needs a CUDA GPU; use 'auto' on a CPU (sdpa, "
                "or eager where the family needs it)"
            )
        if not installed("flash_attn"):
            raise ConfigError("model.attn_implementation: 'flash_attention_2' needs the flash-attn package "
                              "(pip install flash-attn); or use 'auto'")
    if cfg.trainer.kernel_impl == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET",
                                                                             "0") in ("", "0"):
        raise ConfigError("trainer.kernel_impl: 'triton' needs a CUDA GPU (or TRITON_INTERPRET=1, slow, for "
                          "tests); use 'auto' or 'torch' on a CPU")


def resolve_auto(cfg: Config, on_gpu: bool, log: Callable[[str], None] = lambda _m: None) -> Config:
    """`cfg` with its `auto` choices made for this device and model: model.dtype bfloat16 on CUDA, float32 on
    a CPU; model.attn_implementation SDPA, or eager for a family SDPA cannot run right (`log` says so)."""
    model = cfg.model
    if model.dtype == "auto":
        model = dataclasses.replace(model, dtype="bfloat16" if on_gpu else "float32")
    if model.attn_implementation == "auto":
        config = _config_json(model.path)
        attention = resolved_attention("auto", config)
        if attention != "sdpa":
            log(f"model.attn_implementation auto: {attention} for {config['model_type']} "
                f"({attention_refusal(config, 'sdpa').split(';')[0]})")
        model = dataclasses.replace(model, attn_implementation=attention)
    return dataclasses.replace(cfg, model=model)


def _config_json(path: str) -> dict[str, Any] | None:
    """model.path's config.json as a dict; None for the built-in model or one that does not read as a JSON
    object (the model checks name what is wrong with it)."""
    if not path:
        return None
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


# ---------------------------------------------------------------------------------------------------
# The model against the rollout engine (the engine's own conditions: rollout/engine_models.py)


def check_rollout_model(cfg: Config) -> None:
    """What rollout.engine cannot build of model.path's config.json, refused before any process group, weights
    or engine start (`check_engine_model`; LoRA adapters it cannot serve: `check_engine_lora`). A config.json
    that is absent or not JSON, or of a model type flashdapo does not train, is left to the model checks after
    the launch's (model_dir.check_model_dir, check_model_shape), which name what is wrong with the model
    itself."""
    config = _config_json(cfg.model.path)
    if config is not None and config.get("model_type") in SUPPORTED_MODEL_TYPES:
        check_engine_model(cfg.rollout.engine, config, f"model.path={cfg.model.path}")
        check_engine_lora(cfg.rollout.engine, config, cfg.lora.rank, cfg.lora.target_modules,
                          f"model.path={cfg.model.path}")


# ---------------------------------------------------------------------------------------------------
# The model and its tokenizer


@dataclass
class ModelCheck:
    """What `check_model` found: the tokenizer to use and what to say once in the log."""

    tokenizer: Any
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    """The model's config.json values (what an engine's checks read: `check_engine_model`)."""


def check_model(path: str, field_name: str, max_tokens: int, tokens_field: str,
                positions: str = "error") -> ModelCheck:
    """Check the model at `path` against its tokenizer and the run's token budget, from config.json and the
    tokenizer files only: what `check_model_config` checks (a supported architecture; `max_tokens`, prompt +
    response, named by `tokens_field`, within its positions: a sample past them is out of the model's range,
    refused for training and evaluation alike); the tokenizer's vocabulary, pad and eos ids inside the
    model's embedding; a chat template (else the plain one, noted). `positions`='note' only notes a budget
    past the positions (`flashdapo generate` with the torch engine: a look at a model's answers)."""
    where = f"{field_name}={path}"
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    notes = check_model_config(config, where, max_tokens, tokens_field, positions, f"{path}/config.json")
    tokenizer = load_tokenizer(path)
    _check_vocabulary(tokenizer, config, where)
    if not tokenizer.chat_template:
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
        notes.append(f"{path}: the tokenizer has no chat template; prompts use the plain one "
                     "('User: <prompt>\\n\\nAssistant:')")
    check_chat_template(tokenizer, path)
    return ModelCheck(tokenizer, notes, config)


TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
"""Where a model directory keeps its chat template, in the order transformers prefers them."""


def check_chat_template(tokenizer: Any, path: str) -> None:
    """The chat template renders a plain user message, as every prompt is rendered (data.chat_ids). A template
    transformers' sandbox refuses (jinja2's SecurityError: it reaches for Python internals, as a malicious one
    does), or one that does not parse or raises, is one line naming its file, before any data or weights
    load."""
    from jinja2.exceptions import SecurityError, TemplateError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "What is 1 + 1?"}],
                                      add_generation_prompt=True, tokenize=False)
    except TemplateError as err:
        where = next((f"{path}/{name}" for name in TEMPLATE_FILES if (Path(path) / name).is_file()), path)
        what = ((
            "transformers' sandbox refused it: it reaches for Python internals no chat template needs (a "
            "malicious template does)") if isinstance(err, SecurityError) else "it does not render")
        raise ModelDirError(
            f"{where}: the chat template fails on a plain user message ({type(err).__name__}: "
            f"{' '.join(str(err).split())}); {what}: use the model's original tokenizer files, or "
            "fix the template") from err


EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""The config.json keys a mixture-of-experts family's expert count goes by (which one: its registry entry's
config_keys)."""

SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
"""config.json fields every supported family needs, each a positive integer."""


def check_model_config(config: dict[str, Any], where: str, max_tokens: int, tokens_field: str,
                       positions: str = "error", named: str = "config.json") -> list[str]:
    """What a model's config.json alone decides (`flashdapo plan` runs this where the tokenizer is absent):
    what `check_model_shape` checks, and `max_tokens` (prompt + response, named by `tokens_field`) within its
    positions (`positions`: 'error' refuses, 'note' reports it). Returns the notes for the log."""
    check_model_shape(config, where, named)
    notes = []
    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and max_tokens > limit:
        message = (f"{tokens_field} = {max_tokens} tokens > max_position_embeddings={limit} of {named} "
                   "(the model has no positions beyond)")
        if positions == "error":
            raise ModelDirError(f"{message}; lower them to fit")
        notes.append(f"warning: {message}; a sample that long is out of the model's range")
    return notes


def check_model_shape(config: Any, where: str, named: str = "config.json") -> None:
    """A model's config.json (`named`, for `where`) the model can be built from: a JSON object, a supported
    architecture, SHAPE_FIELDS positive integers, key/value heads (when given) dividing the attention heads,
    and the attention heads dividing the width unless head_dim is given. One line each, naming the file and
    the field."""
    if not isinstance(config, dict):
        raise ModelDirError(
            f"{named}: expected a JSON object (a model's config.json), got {type(config).__name__}")
    model_type = config.get("model_type")
    if multimodal_refusal(model_type) is not None:
        raise ModelDirError(f"{where}: {multimodal_refusal(model_type)}")
    if model_type is None:
        classes = ", ".join(map(str, config.get("architectures") or [])) or "no architectures"
        raise ModelDirError(f"{named}: model_type: missing (the file names {classes}); expected the family's "
                            f"model_type, one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        architectures = config.get("architectures")
        architectures = (", ".join(map(str, architectures)) if isinstance(architectures, list) else "") or \
            "no architectures"
        raise ModelDirError(
            f"{where}: model_type {model_type!r} ({architectures}) is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    for name in SHAPE_FIELDS:
        if not _positive_int(config.get(name)):
            raise ModelDirError(f"{named}: {name}: expected a positive integer, got {config.get(name)!r}"
                                + (" (missing)" if name not in config else ""))
    for name in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        if config.get(name) is not None and not _positive_int(config[name]):
            raise ModelDirError(
                f"{named}: {name}: expected a positive integer (or no such key), got {config[name]!r}")
    family = FAMILIES[model_type]
    for name in family.config_keys if family.routers is not None else ():
        value = next((config[k] for k in _spellings(model_type, name) if k in config), None)
        if name in EXPERT_COUNT_KEYS and not _positive_int(value):
            raise ModelDirError(f"{named}: {name}: expected the number of experts, a positive integer, got "
                                f"{value!r}" +
                                (" (missing: transformers would assume a default of its own, which "
                                 "need not be the checkpoint's)" if value is None else ""))
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise ModelDirError(f"{named}: num_key_value_heads: {kv_heads} does not divide num_attention_heads "
                            f"{heads}; expected a divisor of it")
    if config.get("head_dim") is None and config["hidden_size"] % heads:
        raise ModelDirError(f"{named}: num_attention_heads: {heads} does not divide hidden_size "
                            f"{config['hidden_size']} (and no head_dim is given); expected a divisor of it")


def _spellings(model_type: str, name: str) -> list[str]:
    """`name` and the keys transformers' config class of `model_type` reads as the same field (its
    attribute_map: Qwen3-MoE's released config.json says num_experts, transformers 5.19 writes
    num_local_experts)."""
    from transformers import CONFIG_MAPPING

    aliases = getattr(CONFIG_MAPPING[model_type], "attribute_map", {}) if model_type in CONFIG_MAPPING else {}
    return [name] + [k
                     for k, v in aliases.items() if v == name] + [v for k, v in aliases.items() if k == name]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_vocabulary(tokenizer: Any, config: dict[str, Any], where: str) -> None:
    rows = config.get("vocab_size")
    if not _positive_int(rows):
        raise ModelDirError(f"{where}: config.json has no positive integer vocab_size")
    if len(tokenizer) > rows:
        raise ModelDirError(
            f"{where}: the tokenizer has {len(tokenizer):,} tokens but the model's embedding has "
            f"{rows:,} rows (config.json vocab_size): a tokenizer of another model?")
    special = {"pad": [tokenizer.pad_token_id], "eos": eos_token_ids(tokenizer)}
    for name, ids in special.items():
        outside = [i for i in ids if i is not None and not 0 <= i < rows]
        if outside:
            raise ModelDirError(
                f"{where}: the tokenizer's {name} token id {outside[0]} is outside the model's "
                f"embedding (vocab_size {rows}); fix the tokenizer files' special tokens")
    if not eos_token_ids(tokenizer):
        raise ModelDirError(
            f"{where}: the tokenizer has no eos token (nor <|endoftext|> or <|im_end|>): a response "
            "would never end; set eos_token in tokenizer_config.json")

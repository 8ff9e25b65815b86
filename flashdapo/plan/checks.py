"""Every check the launch runs that needs neither the cluster's GPUs nor the weights, through the launch's
own functions (a plan cannot pass where the launch would refuse), and the fit of the memory plan.

Run here: the batch layout over ranks and data-parallel slots (preflight.check_layout); the model's
config.json (preflight.check_model_config: architecture, positions for prompt + response), and with the
checkpoint directory on this machine also its files and tokenizer (model_dir.check_model_dir,
preflight.check_model, as trainer/setup.py does); the sequence-parallel head rule (models/ulysses.py
check_layer_heads); vLLM's tensor-parallel head rule; expert parallelism against the model's experts
(models/moe/expert_parallel.py check_expert_parallel on the meta-built modules; check_layout checks it
against the world size). Not run: what the nodes themselves must have
(preflight.check_machine: CUDA, vLLM, flash-attn, wandb), and the data files when they are not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from ..config import Config, ConfigError, engine_spec
from ..models.attention_limits import check_flash_attention
from ..models.linear_attention import check_sequence_parallel
from ..models.model_dir import check_model_dir
from ..models.moe.expert_parallel import check_expert_parallel
from ..models.ulysses import check_layer_heads
from ..preflight import check_layout, check_model, check_model_config, check_model_settings
from ..rollout.engine_models import check_engine_model
from .model import ModelShape
from .shapes import ModelSource

TOKENS_FIELD = "data.max_prompt_length + rollout.max_response_length"


@dataclass
class CheckReport:
    """What was checked, and what could not be from here."""

    passed: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def launch_checks(cfg: Config, world: int, source: ModelSource, shape: ModelShape,
                  experts: list[nn.Module] | None = None) -> CheckReport:
    """Raise the launch's own one-line error for what it would refuse; else say what passed and what not.
    `experts`: the meta-built model's fused-experts modules (models/moe/expert_parallel.py expert_modules);
    None: expert parallelism is checked against `shape` alone."""
    report = CheckReport(notes=list(source.notes))
    check_layout(cfg, world)
    report.passed.append("batch layout (preflight.check_layout)")
    max_tokens = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if source.model_dir is not None:
        check_model_dir(source.model_dir)
        report.notes += check_model(source.model_dir, "model.path", max_tokens, TOKENS_FIELD).notes
        report.passed.append("model directory and tokenizer (preflight.check_model)")
    elif not source.toy:
        where = f"model.path={cfg.model.path}" if cfg.model.path else source.origin
        report.notes += check_model_config(source.config, where, max_tokens, TOKENS_FIELD,
                                           named=source.origin)
        report.passed.append("model config (preflight.check_model_config)")
        report.not_checked.append("the tokenizer (the checkpoint is not on this machine)")
    if not source.toy:  # the engine's attention-window limits; its architecture registry is checked at launch
        check_model_settings(cfg, source.config,
                             f"model.path={cfg.model.path}" if cfg.model.path else source.origin)
        report.passed.append("model settings against the family (preflight.check_model_settings)")
        check_flash_attention(source.config, cfg.model.attn_implementation,
                              f"model.path={cfg.model.path}" if cfg.model.path else source.origin)
        check_engine_model(cfg.rollout.engine, source.config, source.origin, registry=False)
    if cfg.trainer.sequence_parallel > 1:
        check_sequence_parallel(source.config, cfg.trainer.sequence_parallel)  # refused with linear attention
        check_layer_heads(list(shape.layer_heads), cfg.trainer.sequence_parallel)
        report.passed.append(
            f"sequence_parallel {cfg.trainer.sequence_parallel} heads (ulysses.check_layer_heads)")
    ep = cfg.trainer.expert_parallel
    if ep > 1:  # its world-size rule is check_layout's
        if experts is not None:
            check_expert_parallel(experts, ep)
        elif shape.moe is None or shape.moe.num_experts % ep:
            raise ConfigError(
                f"trainer.expert_parallel={ep}: the model has no MoE layer or num_experts it does "
                "not divide; use 1 for a dense model, else a divisor of num_experts")
        report.passed.append(f"expert_parallel {ep} (models/moe/expert_parallel.check_expert_parallel)")
    if engine_spec(cfg.rollout.engine).tensor_parallel:
        tp = cfg.rollout.tensor_parallel_size
        if shape.heads % tp:
            raise ConfigError(f"rollout.tensor_parallel_size: {tp} does not divide the model's {shape.heads} "
                              "attention heads (vLLM refuses it); use a divisor of them")
        report.passed.append(f"vLLM tensor_parallel_size {tp} heads")
    missing = [f for f in cfg.data.train_files + cfg.data.val_files if not Path(f).exists()]
    if missing:
        report.not_checked.append(f"data files not on this machine ({', '.join(missing)})")
    report.not_checked.append("the nodes' CUDA and packages (preflight.check_machine runs at launch)")
    return report


__all__ = ["CheckReport", "launch_checks"]

"""The pieces of a run that training and split placement's rollout side both build: the tokenizer, the
policy (loaded or built, warmed up, parallelized), the optimizer and the rollout engine."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import Config, engine_spec
from ..distributed.mesh import DistEnv
from ..models.attention_limits import check_flash_attention
from ..models.invariant import make_batch_invariant
from ..models.loading import load_sharded_policy
from ..models.lora import add_adapters
from ..models.model_dir import check_model_dir
from ..models.parallelize import parallelize
from ..models.policy import PolicyModel
from ..preflight import check_model
from ..rollout import RolloutEngine
from ..rollout.factory import build_engine, world_group
from ..sync.check import PushCheck
from ..tasks import build_task_tokenizer
from ..tasks.toy import build_toy_model
from ..tasks.warmup import warm_up_built_in
from ..tools.threads import configure_threads


def checked_tokenizer(cfg: Config, log):
    """The toy task's tokenizer, or model.path's once it and the model passed the checks (preflight.py)."""
    if not cfg.model.path:
        return build_task_tokenizer(cfg.data)
    check_model_dir(cfg.model.path)
    # flash-attn's head-dim limit (Gemma 4's global layers), from config.json before any weights load
    config = json.loads((Path(cfg.model.path) / "config.json").read_text(encoding="utf-8"))
    check_flash_attention(config, cfg.model.attn_implementation, f"model.path={cfg.model.path}")
    check = check_model(cfg.model.path, "model.path",
                        cfg.data.max_prompt_length + cfg.rollout.max_response_length,
                        "data.max_prompt_length + rollout.max_response_length")
    for note in check.notes:
        log(note)
    return check.tokenizer


def build_policy(cfg: Config, env: DistEnv, tokenizer, resuming: bool, log) -> PolicyModel:
    """The policy as trained: model.path's checkpoint loaded into FSDP2 shards, or the toy model built,
    warmed up (fresh runs) and parallelized."""
    if cfg.model.path:
        policy = load_sharded_policy(cfg, env, log)
        configure_threads(sum(p.numel() for p in policy.parameters()), env.device)
        return policy.with_route_replay(cfg.algorithm.routing_replay)
    max_positions = cfg.data.max_prompt_length + cfg.rollout.max_response_length + 8
    hf_model = build_toy_model(cfg.model, len(tokenizer), max_positions, cfg.trainer.seed)
    configure_threads(sum(p.numel() for p in hf_model.parameters()), env.device)  # before the warm-up
    policy = PolicyModel(hf_model, cfg.model.attn_implementation, cfg.trainer.kernel_impl,
                         cfg.rollout.temperature).with_route_replay(cfg.algorithm.routing_replay)
    if not resuming or cfg.lora.enabled:  # LoRA's checkpoints hold only the adapters: the base is rebuilt
        # Same seed, same data, same arithmetic on every rank: every rank gets the same base model.
        warm_up_built_in(policy, cfg, tokenizer, log=log if env.is_main else (lambda _m: None))
    if cfg.lora.enabled:
        add_adapters(policy.hf, cfg.lora, cfg.trainer.seed)
    if cfg.trainer.batch_invariant:  # after the warm-up: its SFT needs no invariance
        make_batch_invariant(policy, torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32,
                             env.device, cfg.rollout.engine)
    return parallelize(policy, env, cfg.model, cfg.trainer)


def build_optimizer(cfg: Config, policy: PolicyModel):
    """AdamW over the policy's trainable parameters (the adapters alone under LoRA) and its warm-up
    schedule."""
    oc = cfg.optim
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.peak_lr, betas=oc.betas, eps=oc.eps,
                                  weight_decay=oc.weight_decay)
    # Linear warmup over `warmup_steps` training steps (the first step already uses lr/warmup), then constant;
    # the loop steps the schedule only after a training step that took an optimizer step.
    warmup = max(oc.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    return optimizer, scheduler


def training_engine(cfg: Config, env: DistEnv, policy: PolicyModel, tokenizer, error_log: Path,
                    log) -> RolloutEngine:
    """The engine that samples the policy during training (co-located, or split placement's rollout side):
    the torch engine over the policy itself, or an engine with its own weights whose every push is checked."""
    push_check = PushCheck(policy, env.device, policy.config.vocab_size, log,
                           tokenizer_size=len(tokenizer)) if engine_spec(
                               cfg.rollout.engine).own_weights else None
    return build_engine(cfg.rollout, env, tokenizer, model=policy, model_path=cfg.model.path,
                        dtype=cfg.model.dtype, seed=cfg.trainer.seed,
                        max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_response_length,
                        shard_group=world_group(env), reshard_after_forward=cfg.trainer.reshard_after_forward,
                        verify_push=push_check, error_log=error_log,
                        record_routes=cfg.algorithm.routing_replay == "r3",
                        batch_invariant=cfg.trainer.batch_invariant)


def parameter_counts(policy: PolicyModel) -> str:
    """'N parameters (M in this rank's shards)', or under LoRA 'N trainable of M parameters (...)': a
    DTensor's numel is the full tensor's, to_local() its shard."""
    from torch.distributed.tensor import DTensor

    full = sum(p.numel() for p in policy.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    counts = f"{trainable:,} trainable of {full:,} parameters" if trainable < full else f"{full:,} parameters"
    return f"{counts} ({local:,} in this rank's shards)"


__all__ = ["build_optimizer", "build_policy", "checked_tokenizer", "parameter_counts", "training_engine"]

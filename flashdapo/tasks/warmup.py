"""Supervised warm-up of a built-in task's model: the "base model" DAPO starts from.

Cross-entropy on response tokens only, through the same packing and fused log-prob path as DAPO, at
temperature 1 whatever temperature the RL phase samples at. Deterministic for the given examples and
seed, so every rank produces the same base model without communicating.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from ..config import Config
from ..data import Record, chat_ids
from ..models.policy import PolicyModel
from . import task_sft_examples


def supervised_warmup(policy: PolicyModel, tokenizer, examples: Sequence[tuple[Record, str]], *, steps: int,
                      batch: int, lr: float, name: str = "toy",
                      log: Callable[[str], None] = print) -> list[float]:
    """Train on `examples` (prompt record, response text) for `steps` steps of `batch` pairs each, with AdamW
    at `lr`; each response ends with the tokenizer's eos. Returns the per-step losses."""
    if steps == 0:
        return []
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pairs = [(torch.tensor(chat_ids(tokenizer, rec.messages)),
              torch.tensor(tokenizer.encode(text, add_special_tokens=False) + [eos]))
             for rec, text in examples]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    device = next(policy.parameters()).device
    losses = []
    policy.train()
    rl_temperature, policy.temperature = policy.temperature, 1.0
    try:
        for step in range(steps):
            chunk = pairs[step * batch:(step + 1) * batch]
            packed = policy.token_batch([p for p, _ in chunk], [r for _, r in chunk], device)
            logp, _ = policy(packed)
            loss = -logp.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        policy.temperature = rl_temperature
    log(f"{name} warm-up: {steps} supervised steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


def warm_up_built_in(policy: PolicyModel, cfg: Config, tokenizer, log: Callable[[str],
                                                                                None] = print) -> list[float]:
    """The supervised warm-up of the built-in task `cfg.data.task` with `cfg.model.toy`'s settings, seeded by
    `cfg.trainer.seed`: the same base model on every rank and in every run of the same config."""
    toy = cfg.model.toy
    examples = task_sft_examples(cfg.data, toy.sft_steps * toy.sft_batch, random.Random(cfg.trainer.seed))
    return supervised_warmup(policy, tokenizer, examples, steps=toy.sft_steps, batch=toy.sft_batch,
                             lr=toy.sft_lr, name=cfg.data.task, log=log)

"""The toy preset's "base model": a tiny Qwen2-style model, then a deliberately brief supervised warm-up
on the toy task, so that DAPO starts from a policy that knows the answer format but is often wrong.

Real runs load an HF checkpoint instead (`model.path`) and skip all of this.
"""

from __future__ import annotations

import random

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ..config import Config, ModelConfig
from ..data import chat_ids, toy_sft_examples
from .policy import PolicyModel


def build_toy_model(cfg: ModelConfig, vocab_size: int, max_positions: int, seed: int) -> Qwen2ForCausalLM:
    """A tiny Qwen2 from a config (no download), initialized from `seed`, fp32."""
    toy = cfg.toy
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=toy.hidden_size, intermediate_size=toy.intermediate_size,
        num_hidden_layers=toy.num_layers, num_attention_heads=toy.num_heads, num_key_value_heads=toy.num_kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True, attn_implementation=cfg.attn_implementation,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def supervised_warmup(policy: PolicyModel, tokenizer, cfg: Config, log=print) -> list[float]:
    """Train on (toy prompt, correct 'Answer: N' response) pairs for model.toy.sft_steps steps.

    Cross-entropy on response tokens only, through the same packing and fused log-prob path as DAPO.
    Deterministic for trainer.seed, so every rank produces the same base model. Returns the losses.
    """
    toy = cfg.model.toy
    if toy.sft_steps == 0:
        return []
    rng = random.Random(cfg.trainer.seed)
    examples = toy_sft_examples(cfg.data.toy, toy.sft_steps * toy.sft_batch, rng)
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pairs = [(torch.tensor(chat_ids(tokenizer, rec.messages)),
              torch.tensor(tokenizer.encode(text, add_special_tokens=False) + [eos])) for rec, text in examples]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=toy.sft_lr, weight_decay=0.0)
    device = next(policy.parameters()).device
    losses = []
    policy.train()
    for step in range(toy.sft_steps):
        chunk = pairs[step * toy.sft_batch:(step + 1) * toy.sft_batch]
        packed = policy.token_batch([p for p, _ in chunk], [r for _, r in chunk], device)
        logp, _ = policy(packed)
        loss = -logp.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    log(f"toy warm-up: {toy.sft_steps} supervised steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses

"""A toy Qwen2 export that vLLM's CPU attention runs (head size 32: model.toy.hidden_size / num_heads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flashdapo.config import ModelConfig, ToyTaskConfig
from flashdapo.tasks.toy import build_toy_model, build_toy_tokenizer, toy_records
from flashdapo.trainer.state.export import export_hf

HIDDEN, HEADS = 64, 2  # head size 32, the smallest vLLM's CPU attention supports
KV_GIB = 0.03125  # 32 MiB of KV cache per rank: thousands of toy tokens, never the host's RAM


def toy_export(path: Path, tied: bool = True, head_dim: int = HIDDEN // HEADS) -> Path:
    """An HF directory (config with `architectures`, safetensors, tokenizer) of a 1-layer toy Qwen2 from
    seed 0; `tied=False` gives it its own LM head (a perturbed copy of the embedding)."""
    tokenizer = build_toy_tokenizer(ToyTaskConfig())
    cfg = ModelConfig()
    cfg.toy.hidden_size, cfg.toy.num_heads, cfg.toy.num_kv_heads = head_dim * HEADS, HEADS, 1
    cfg.toy.intermediate_size, cfg.toy.num_layers = 96, 1
    model = build_toy_model(cfg, len(tokenizer), max_positions=512, seed=0)
    if not tied:
        model.config.tie_word_embeddings = False
        with torch.random.fork_rng():
            torch.manual_seed(1)
            head = model.model.embed_tokens.weight.detach() + 0.05 * torch.randn_like(model.model.embed_tokens.weight)
        model.lm_head.weight = torch.nn.Parameter(head)
    export_hf(model.named_parameters(), model.config, tokenizer, path, True)
    return path



def toy_train_file(path: Path, rows: int = 64) -> Path:
    """The toy task's training problems as a DAPO-schema jsonl: a run from a model directory trains on files."""
    records = toy_records(ToyTaskConfig(num_train=rows), "train")
    path.write_text("".join(json.dumps({"prompt": r.messages, "reward_model": {"ground_truth": r.ground_truth}}) + "\n"
                            for r in records))
    return path

"""A toy Qwen2 export that vLLM's CPU attention runs (head size 32: model.toy.hidden_size / num_heads), and
the tiny DAPO config the real-vLLM tests train with."""

from __future__ import annotations

from pathlib import Path

import torch

from flashdapo.config import ModelConfig, ToyTaskConfig, merge, toy
from flashdapo.tasks.toy import build_toy_model, build_toy_tokenizer
from flashdapo.trainer.checkpoint import export_hf

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


def vllm_config(run_dir: Path, model_path: Path, **overrides):
    """The toy preset on `model_path` with the vLLM engine, shrunk to seconds per step."""
    small = {
        "model": {"path": str(model_path)},
        "data": {"toy": {"num_val": 4}, "max_prompt_length": 48},
        "rollout": {"engine": "vllm", "n": 4, "val_n": 2, "max_response_length": 16, "kv_cache_gib": KV_GIB,
                    "logprob_check_every": 1},
        "algorithm": {"dynamic_sampling": False},
        "trainer": {"total_steps": 2, "train_batch": 4, "gen_batch": 4, "mini_batch": 2, "val_every": 0,
                    "micro_batch_tokens": 256},
        "checkpoint": {"save_every": 0},
        "logging": {"run_dir": str(run_dir), "plot": False, "progress": False},
    }
    cfg = merge(toy(), small)
    return merge(cfg, overrides) if overrides else cfg

"""Named presets: each states only what differs from the defaults of the tree. `toy` is the default."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .checks import ConfigError
from .io import load_file, merge
from .tree import Config


def toy() -> Config:
    """CPU, minutes: a tiny Qwen2-style model learns the built-in arithmetic task with full DAPO."""
    return merge(Config(), {
        # 'Answer: 18' + EOS is 6 tokens: free up to 6, penalized over 7..10, truncated (-1 more) beyond.
        "rollout": {"n": 8, "max_response_length": 10, "val_n": 4},
        "algorithm": {"overlong_buffer_len": 4, "max_gen_batches": 4, "on_max_gen_batches": "continue"},
        "optim": {"lr": 5e-4, "weight_decay": 0.0, "warmup_steps": 2},
        "trainer": {"total_steps": 240, "train_batch": 32, "gen_batch": 48, "mini_batch": 4,
                    "micro_batch_tokens": 4096, "val_every": 20},
        "checkpoint": {"save_every": 50, "keep_last": 2},
        "logging": {"run_dir": "runs/toy"},
    })


def qwen25_7b_math() -> Config:
    """Qwen2.5-7B (base) on DAPO-Math-17k, one 8-GPU node (80 GB each), co-located vLLM.

    Memory reasoning in docs/vllm.md. Qwen2.5-Math-7B would need max_response_length <= 2048: its
    config allows 4096 positions, which vLLM enforces.
    """
    return merge(Config(), {
        "model": {"path": "checkpoints/Qwen2.5-7B", "dtype": "bfloat16", "gradient_checkpointing": True},
        "data": {"train_files": ["data/dapo-math-17k.parquet"], "val_files": ["data/aime-2024.parquet"],
                 "dedup": True},
        "rollout": {"engine": "vllm", "max_response_length": 8192, "max_num_batched_tokens": 16384},
        "algorithm": {"overlong_buffer_len": 2048},
        "trainer": {"total_steps": 300, "train_batch": 128, "gen_batch": 384, "mini_batch": 16,
                    "micro_batch_tokens": 16384, "val_every": 10},
        "checkpoint": {"save_every": 10},
        "logging": {"run_dir": "runs/qwen2.5-7b-math"},
    })


def qwen25_32b_dapo() -> Config:
    """The released DAPO recipe for Qwen2.5-32B (docs/algorithm.md), on 16 nodes x 8 GPUs. The tree's
    defaults are that recipe's values; this adds the model, data and the cluster's layout.

    Not reproduced by flashdapo: the recipe's sequence parallelism of 8 (Ulysses).
    """
    return merge(Config(), {
        "model": {"path": "checkpoints/Qwen2.5-32B", "dtype": "bfloat16", "gradient_checkpointing": True},
        "data": {"train_files": ["data/dapo-math-17k.parquet"], "val_files": ["data/aime-2024.parquet"]},
        "rollout": {"engine": "vllm", "tensor_parallel_size": 4, "gpu_memory_utilization": 0.7,
                    "max_num_batched_tokens": 22528},
        "trainer": {"total_steps": 400, "fsdp_cpu_offload": True},
        "logging": {"run_dir": "runs/qwen2.5-32b-dapo"},
    })


PRESETS: dict[str, Callable[[], Config]] = {
    "toy": toy,
    "qwen2.5-7b-math": qwen25_7b_math,
    "qwen2.5-32b-dapo": qwen25_32b_dapo,
}
DEFAULT_PRESET = "toy"


def preset(name: str) -> Config:
    """The named preset; unknown names list the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


def starting_point(argv: list[str], default_preset: str | None) -> tuple[Config, list[str], str]:
    """Read `--preset NAME` and `--config FILE` off `argv`: (that config, the other arguments, a phrase
    saying where the defaults come from). Without --preset, `default_preset` (None: the tree's defaults)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default=default_preset)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    base = preset(known.preset) if known.preset else Config()
    if known.config:
        base = load_file(known.config, base)
    start = f"preset '{known.preset}'" if known.preset else "the config tree's defaults"
    return base, rest, start + (f" + {known.config}" if known.config else "")

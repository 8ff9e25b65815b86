"""Named presets: each is the set of fields that differ from the tree's defaults. `toy` is the default.

The defaults themselves are the released DAPO recipe's values (docs/algorithm.md, section 6), so the
32B preset only adds the model, the data and the cluster's layout.
"""

from __future__ import annotations

import argparse
from typing import Any

from .checks import ConfigError
from .io import load_file, merge
from .tree import Config

PRESETS: dict[str, dict[str, Any]] = {
    # CPU, minutes: a tiny Qwen2-style model learns the built-in arithmetic task with full DAPO.
    # 'Answer: 18' + EOS is 6 tokens: free up to 6, penalized over 7..10, truncated (-1 more) beyond.
    "toy": {
        "rollout": {"n": 8, "max_response_length": 10, "val_n": 4},
        "algorithm": {"overlong_buffer_len": 4, "max_gen_batches": 4, "on_max_gen_batches": "continue"},
        "optim": {"lr": 5e-4, "weight_decay": 0.0, "warmup_steps": 2},
        "trainer": {"total_steps": 240, "train_batch": 32, "gen_batch": 48, "mini_batch": 4,
                    "micro_batch_tokens": 4096, "val_every": 20},
        "checkpoint": {"save_every": 50, "keep_last": 2},
        "logging": {"run_dir": "runs/toy"},
    },
    # Qwen2.5-7B (base) on DAPO-Math-17k, one 8-GPU node (80 GB each), co-located vLLM; memory reasoning
    # in docs/vllm.md. Qwen2.5-Math-7B would need max_response_length <= 2048: its config allows 4096
    # positions, which vLLM enforces.
    "qwen2.5-7b-math": {
        "model": {"path": "checkpoints/Qwen2.5-7B", "dtype": "bfloat16", "gradient_checkpointing": True},
        "data": {"train_files": ["data/dapo-math-17k.parquet"], "val_files": ["data/aime-2024.parquet"],
                 "dedup": True},
        "rollout": {"engine": "vllm", "max_response_length": 8192, "max_num_batched_tokens": 16384},
        "algorithm": {"overlong_buffer_len": 2048},
        "trainer": {"total_steps": 300, "train_batch": 128, "gen_batch": 384, "mini_batch": 16,
                    "micro_batch_tokens": 16384, "val_every": 10},
        "checkpoint": {"save_every": 10},
        "logging": {"run_dir": "runs/qwen2.5-7b-math"},
    },
    # The released recipe for Qwen2.5-32B on 16 nodes x 8 GPUs. Not reproduced by flashdapo: the recipe's
    # sequence parallelism of 8 (Ulysses).
    "qwen2.5-32b-dapo": {
        "model": {"path": "checkpoints/Qwen2.5-32B", "dtype": "bfloat16", "gradient_checkpointing": True},
        "data": {"train_files": ["data/dapo-math-17k.parquet"], "val_files": ["data/aime-2024.parquet"]},
        "rollout": {"engine": "vllm", "tensor_parallel_size": 4, "gpu_memory_utilization": 0.7,
                    "max_num_batched_tokens": 22528},
        # Ulysses sp=8 as released: 40 query and 8 key/value heads split 8 ways (docs/architecture.md).
        "trainer": {"total_steps": 400, "fsdp_cpu_offload": True, "sequence_parallel": 8},
        "logging": {"run_dir": "runs/qwen2.5-32b-dapo"},
    },
}
"""Each preset's fields that differ from the defaults."""
DEFAULT_PRESET = "toy"


def preset(name: str) -> Config:
    """The named preset; unknown names list the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return merge(Config(), PRESETS[name])


def toy() -> Config:
    """The default preset (see PRESETS)."""
    return preset("toy")


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

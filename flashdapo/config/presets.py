"""Named presets: each is the set of fields that differ from the tree's defaults. `toy` is the default.

The defaults themselves are the released DAPO recipe's values (docs/algorithm.md, section 6), so the
32B preset only adds the model, the data and the cluster's layout. No preset sets model.dtype: its `auto`
computes in bfloat16 on GPUs and float32 on a CPU. Every preset uses the released verifier, `dapo`.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    # CPU: the task of `flashdapo ablate` (docs/ablation.md): 1- and 2-digit addition with written work, the
    # toy's model shape (118k parameters) warmed up longer. Compact worked answers take 13..23 tokens (free
    # up to 30); long-hand ones 32..57, so two-digit long-hand answers are truncated at 40.
    "scratchpad": {
        "model": {"toy": {"sft_steps": 600}},
        "data": {"task": "scratchpad", "max_prompt_length": 48},
        "rollout": {"n": 8, "max_response_length": 40, "val_n": 4},
        "algorithm": {"overlong_buffer_len": 10, "max_gen_batches": 3, "on_max_gen_batches": "continue"},
        "optim": {"lr": 3e-4, "weight_decay": 0.0, "warmup_steps": 2},
        "trainer": {"total_steps": 60, "train_batch": 16, "gen_batch": 32, "mini_batch": 4,
                    "micro_batch_tokens": 4096, "val_every": 10},
        "checkpoint": {"save_every": 20, "keep_last": 1},
        "logging": {"run_dir": "runs/scratchpad"},
    },
    # CPU: the toy task with heavy-tailed response lengths (bench/bench_longtail.py, docs/algorithm.md
    # "Streaming"): warm-up answers open with a lognormal number of filler tokens (median 8, capped at 160);
    # with the answer line and EOS the longest demonstration is 174 tokens, under the limit of 192. A round
    # (48 prompts x 8) is decoded as one batch.
    "longtail": {
        "data": {"toy": {"filler_median": 8.0}},  # filler_sigma: its default, 1.0
        "rollout": {"n": 8, "max_response_length": 192, "val_n": 4, "max_num_seqs": 384},
        "algorithm": {"overlong_buffer_len": 16, "max_gen_batches": 4, "on_max_gen_batches": "continue"},
        "optim": {"lr": 5e-4, "weight_decay": 0.0, "warmup_steps": 2},
        "trainer": {"total_steps": 40, "train_batch": 32, "gen_batch": 48, "mini_batch": 4,
                    "micro_batch_tokens": 4096, "val_every": 20},
        "checkpoint": {"save_every": 20, "keep_last": 1},
        "logging": {"run_dir": "runs/longtail"},
    },
    # Qwen2.5-7B (base) on DAPO-Math-17k, one 8-GPU node (80 GB each), co-located vLLM; memory reasoning
    # in docs/vllm.md. Qwen2.5-Math-7B would need max_response_length <= 2048: its config allows 4096
    # positions, which vLLM enforces.
    "qwen2.5-7b-math": {
        "model": {"path": "checkpoints/Qwen2.5-7B", "gradient_checkpointing": True},
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
        "model": {"path": "checkpoints/Qwen2.5-32B", "gradient_checkpointing": True},
        "data": {"train_files": ["data/dapo-math-17k.parquet"], "val_files": ["data/aime-2024.parquet"]},
        "rollout": {"engine": "vllm", "tensor_parallel_size": 4, "gpu_memory_utilization": 0.7,
                    "max_num_batched_tokens": 22528},
        # Ulysses sp=8 as released: 40 query and 8 key/value heads split 8 ways (docs/architecture.md).
        "trainer": {"total_steps": 400, "fsdp_cpu_offload": True, "sequence_parallel": 8},
        "logging": {"run_dir": "runs/qwen2.5-32b-dapo"},
    },
    # The released 32B recipe's lengths and batches (the defaults, as qwen2.5-32b-dapo) with LoRA: rank-32
    # adapters on every linear layer of the decoder blocks (268M trainable of 33.0B), the base frozen in bf16.
    # The trainer holds 65.5 GB of bf16 base over its ranks instead of 524 GB of fp32 state, so one node of
    # 8 GPUs (H100 80 GB or H20 96 GB) fits without CPU offload or sequence parallelism: `flashdapo plan
    # --preset qwen2.5-32b-dapo-lora` models 64.5 GiB in generation on an H100, 75.7 on an H20; 41.7 GiB in
    # training (docs/plan.md, "LoRA"). Rank: memory hardly depends on it (rank 64 adds about half a GiB per
    # GPU), so it is chosen for learning: RL's reward carries little information per episode, so a low rank
    # suffices (docs/plan.md), and 32 keeps alpha 32's scale at 1. The peak rate is optim.lr x lora.lr_scale,
    # 1e-5: the ~10x of full training's rate that LoRA Without Regret reports for large models (reported, not
    # measured here; on the toy 1-2x learns best: docs/lora.md).
    "qwen2.5-32b-dapo-lora": {
        "model": {"path": "checkpoints/Qwen2.5-32B", "gradient_checkpointing": True},
        "lora": {"rank": 32, "lr_scale": 10.0},
        "data": {"train_files": ["data/dapo-math-17k.parquet"], "val_files": ["data/aime-2024.parquet"]},
        "rollout": {"engine": "vllm", "tensor_parallel_size": 4, "gpu_memory_utilization": 0.7,
                    "max_num_batched_tokens": 22528},
        "trainer": {"total_steps": 400},
        "logging": {"run_dir": "runs/qwen2.5-32b-dapo-lora"},
    },
    # The DAPO recipe (the defaults) on Qwen3-30B-A3B, the mixture-of-experts model (30.5B parameters, 3.3B
    # active per token), on 4 nodes x 8 GPUs (H100 80 GB or H20 96 GB). expert_parallel 8: a node's 8 GPUs
    # split each layer's 128 experts 16 apiece, so the token all-to-all stays on NVLink. The fp32 state
    # (30.5B x 16 bytes) is 14 GiB a rank over 32 ranks: no CPU offload, no sequence parallelism needed;
    # vLLM at tensor_parallel_size 4 holds 14 GiB of bf16 weights a rank, one of the 4 KV heads each
    # (`flashdapo plan --preset qwen3-30b-a3b-dapo`, docs/plan.md). 2 nodes fit too, with less headroom.
    "qwen3-30b-a3b-dapo": {
        "model": {"path": "checkpoints/Qwen3-30B-A3B", "gradient_checkpointing": True},
        "data": {"train_files": ["data/dapo-math-17k.parquet"], "val_files": ["data/aime-2024.parquet"]},
        "rollout": {"engine": "vllm", "tensor_parallel_size": 4, "gpu_memory_utilization": 0.7,
                    "max_num_batched_tokens": 22528},
        "trainer": {"total_steps": 400, "expert_parallel": 8},
        "logging": {"run_dir": "runs/qwen3-30b-a3b-dapo"},
    },
}
"""Each preset's fields that differ from the defaults."""
DEFAULT_PRESET = "toy"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A launch: `nodes` x `gpus_per_node` ranks (torchrun --nnodes / --nproc-per-node)."""

    nodes: int
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


PRESET_CLUSTERS: dict[str, tuple[Cluster, ...]] = {
    "toy": (Cluster(1, 1), Cluster(1, 2)),
    "scratchpad": (Cluster(1, 1), Cluster(1, 2)),
    "longtail": (Cluster(1, 1), Cluster(1, 2)),
    "qwen2.5-7b-math": (Cluster(1, 8), Cluster(16, 8)),  # 16 x 8: 128 slots, 2 responses each per mini-batch
    "qwen2.5-32b-dapo": (Cluster(16, 8), Cluster(8, 8)),  # the released recipe: 16 nodes x 8 GPUs
    # LoRA: one node; half a node (one 4-GPU engine, tensor_parallel_size 4) is the smallest launch that fits
    "qwen2.5-32b-dapo-lora": (Cluster(1, 8), Cluster(1, 4)),
    "qwen3-30b-a3b-dapo": (Cluster(4, 8), Cluster(2, 8)),  # 4 x 8: 32 ranks, 4 expert-parallel groups
}
"""The launches each preset is documented for (docs/usage.md, docs/plan.md); the first is `flashdapo plan`'s
default. tests/test_preflight.py checks every preset's launch at each of them."""


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


def differences(cfg: Any, base: Any) -> dict[str, Any]:
    """The fields of `cfg` whose values differ from `base`'s, nested by section (what a preset is)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        mine, theirs = getattr(cfg, f.name), getattr(base, f.name)
        if dataclasses.is_dataclass(mine):
            sub = differences(mine, theirs)
            if sub:
                out[f.name] = sub
        elif mine != theirs:
            out[f.name] = mine
    return out


def compact_summary(cfg: Config) -> list[str]:
    """The resolved config, compactly: per section one line of the fields that differ from the tree's
    defaults ('optim: lr=0.0005 warmup_steps=2'); a section at its defaults is left out."""
    def flat(values: dict[str, Any], prefix: str = "") -> list[str]:
        return [
            item for name, value in values.items()
            for item in (flat(value, f"{prefix}{name}."
                              ) if isinstance(value, dict) else [f"{prefix}{name}={_short(value)}"])
        ]

    return [f"{section}: {' '.join(flat(values))}" for section, values in differences(cfg, Config()).items()]


def _short(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "[]"
    return str(value) if value != "" else "''"

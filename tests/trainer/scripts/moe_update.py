"""torchrun script: tests.helpers.moe.fixed_batch_update by the ranks torchrun starts.
argv: OUT_DIR LAYOUT (packed | padded) SP [deepseek_v3] [checkpointing]: Qwen3-MoE with router loss 0.5 unless
deepseek_v3 (no router loss); activation checkpointing with `checkpointing`."""

import sys
from pathlib import Path

from tests.helpers.moe import fixed_batch_update

flags = set(sys.argv[4:])
deepseek = "deepseek_v3" in flags
fixed_batch_update(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), coef=None if deepseek else 0.5,
                   family="deepseek_v3" if deepseek else "qwen3_moe", checkpointing="checkpointing" in flags)

"""Built-in tasks (a run without data files trains on one), and the train/validation sets of a run.

`data.py` reads prompt files and knows no task; each task module builds records on top of it.
`data.task` picks the built-in task: `toy` (toy.py) or `scratchpad` (scratchpad.py).
"""

from __future__ import annotations

import random
from typing import Any

from ..config import DataConfig
from ..data import PromptDataset, Record, load_eval_prompts, load_prompts, prompts_from_records
from .scratchpad import build_scratchpad_tokenizer, scratchpad_records, scratchpad_sft_examples
from .toy import build_toy_tokenizer, toy_records, toy_sft_examples


def task_records(cfg: DataConfig, split: str) -> list[Record]:
    """The built-in task's records of `split` ('train' or 'val')."""
    if cfg.task == "scratchpad":
        return scratchpad_records(cfg.scratchpad, split)
    return toy_records(cfg.toy, split)


def task_num_val(cfg: DataConfig) -> int:
    """Validation problems of the built-in task."""
    return cfg.scratchpad.num_val if cfg.task == "scratchpad" else cfg.toy.num_val


def build_task_tokenizer(cfg: DataConfig) -> Any:
    """The tokenizer trained on the built-in task's text (deterministic)."""
    return build_scratchpad_tokenizer(cfg.scratchpad) if cfg.task == "scratchpad" else build_toy_tokenizer(
        cfg.toy)


def task_sft_examples(cfg: DataConfig, n: int, rng: random.Random) -> list[tuple[Record, str]]:
    """`n` supervised warm-up (prompt record, response) pairs of the built-in task."""
    if cfg.task == "scratchpad":
        return scratchpad_sft_examples(cfg.scratchpad, n, rng)
    return toy_sft_examples(cfg.toy, n, rng)


def build_datasets(cfg: DataConfig, tokenizer: Any) -> tuple[PromptDataset, PromptDataset | None]:
    """(train, val) from cfg.train_files / cfg.val_files, or the built-in task (`cfg.task`) when train_files
    is empty."""
    if not cfg.train_files:
        train = prompts_from_records(task_records(cfg, "train"), tokenizer, cfg, [f"{cfg.task}:train"])
        val = (prompts_from_records(task_records(cfg, "val"), tokenizer, cfg, [f"{cfg.task}:val"])
               if task_num_val(cfg) > 0 and not cfg.val_files else None)
    else:
        train, val = load_prompts(cfg.train_files, tokenizer, cfg), None
    if cfg.val_files:
        # Evaluation sets repeat each problem (AIME-2024: 30 x 32 rows); k samples per unique prompt.
        val = load_eval_prompts(cfg.val_files, tokenizer, cfg)
    return train, val

"""Built-in tasks (a run without data files trains on one), and the train/validation sets of a run.

`data.py` reads prompt files and knows no task; each task module builds records on top of it.
"""

from __future__ import annotations

from typing import Any

from ..config import DataConfig
from ..data import PromptDataset, load_eval_prompts, load_prompts, prompts_from_records
from .toy import toy_records


def build_datasets(cfg: DataConfig, tokenizer: Any) -> tuple[PromptDataset, PromptDataset | None]:
    """(train, val) from cfg.train_files / cfg.val_files, or the toy task when train_files is empty."""
    if not cfg.train_files:
        train = prompts_from_records(toy_records(cfg.toy, "train"), tokenizer, cfg, ["toy:train"])
        val = (prompts_from_records(toy_records(cfg.toy, "val"), tokenizer, cfg, ["toy:val"])
               if cfg.toy.num_val > 0 and not cfg.val_files else None)
    else:
        train, val = load_prompts(cfg.train_files, tokenizer, cfg), None
    if cfg.val_files:
        # Evaluation sets repeat each problem (AIME-2024: 30 x 32 rows); k samples per unique prompt.
        val = load_eval_prompts(cfg.val_files, tokenizer, cfg)
    return train, val

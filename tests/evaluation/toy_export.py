"""A tiny untrained toy model exported as an HF directory, and evaluation files in the DAPO schema."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from flashdapo.config import ModelConfig, ToyTaskConfig
from flashdapo.data import DAPO_TEMPLATE
from flashdapo.tasks.toy import build_toy_model, build_toy_tokenizer, toy_records
from flashdapo.trainer.state.export import export_hf


def toy_export(path: Path) -> Path:
    """An HF directory (config, safetensors, tokenizer) holding a 1-layer toy Qwen2 initialized from seed 0."""
    tokenizer = build_toy_tokenizer(ToyTaskConfig())
    cfg = ModelConfig()
    cfg.toy.hidden_size, cfg.toy.intermediate_size, cfg.toy.num_layers = 16, 32, 1
    model = build_toy_model(cfg, len(tokenizer), max_positions=2048, seed=0)
    export_hf(iter(model.state_dict().items()), model.config, tokenizer, path, True)
    return path


def dapo_rows(problems: list[tuple[str, str]], source: str) -> list[dict]:
    """Rows with the columns of the public AIME-2024 parquet (DAPO-Math-17k schema)."""
    return [{"data_source": source,
             "prompt": [{"content": DAPO_TEMPLATE.format(problem=p), "role": "user"}],
             "ability": "MATH",
             "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": i, "raw_problem": p, "split": None},
             "__index_level_0__": i} for i, (p, a) in enumerate(problems)]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def two_source_parquet(path: Path, per_source: int = 3) -> Path:
    """Toy arithmetic problems under two data sources ('arith_a', 'arith_b'), each row twice."""
    records = toy_records(ToyTaskConfig(num_val=2 * per_source), "val")
    rows = [{"data_source": "arith_a" if i < per_source else "arith_b", "prompt": r.messages, "ability": "MATH",
             "reward_model": {"ground_truth": r.ground_truth, "style": "rule"}} for i, r in enumerate(records)]
    return write_parquet(path, rows + rows)

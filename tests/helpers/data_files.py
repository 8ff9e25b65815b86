"""Data files in the DAPO schema: the toy task's problems as a training jsonl or an AIME-style parquet."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from flashdapo.config import ToyTaskConfig
from flashdapo.tasks.toy import toy_records


def train_file(path: Path, rows: int = 8) -> Path:
    """Toy problems in the DAPO-Math-17k schema."""
    lines = [json.dumps({"prompt": r.messages, "reward_model": {"ground_truth": r.ground_truth}})
             for r in toy_records(ToyTaskConfig(num_val=rows), "val")]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_aime_style_parquet(path, records):
    """A parquet in the DAPO / AIME-2024 schema (prompt chat list, reward_model.ground_truth, extras)."""
    table = pa.table({
        "data_source": ["toy"] * len(records),
        "prompt": [r.messages for r in records],
        "ability": ["MATH"] * len(records),
        "reward_model": [{"ground_truth": r.ground_truth, "style": "rule"} for r in records],
        "extra_info": [{"index": i} for i in range(len(records))],
    })
    pq.write_table(table, path)

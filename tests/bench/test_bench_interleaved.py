"""bench/bench_interleaved.py at the smoke shape: every provider timed every round, ratios to the last."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `bench` is a top-level folder, not installed

from bench import bench_interleaved  # noqa: E402


def test_interleaved_table_has_every_provider_and_round(tmp_path):
    providers = ["torch", "torch-fused", "gemm-floor", "naive"]
    assert bench_interleaved.main(["--shape", "smoke", "--rounds", "2", "--providers", ",".join(providers),
                                   "--out", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("*-interleaved-1t.md")
    rows = [line for line in report.read_text().splitlines() if line.startswith("| ") and "provider" not in line]
    assert [r.split(" | ")[0][2:] for r in rows] == providers
    assert rows[-1].split(" | ")[2] == "1.000x", "the last provider is the baseline"
    assert all(len(r.split(" | ")[5].split(",")) == 2 for r in rows), "one CPU time per round"

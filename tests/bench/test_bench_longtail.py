"""bench/bench_longtail.py in smoke mode (every arm, one rank, in this process), the engines it runs (both
stream; one that did not would be named in one line), and the H20 model's roofline."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `bench` is a top-level folder, not installed

from bench import bench_longtail, longtail_model  # noqa: E402


def test_smoke_runs_every_arm_and_writes_ratios_to_rounds(tmp_path):
    assert bench_longtail.main(["--smoke", "--work", str(tmp_path / "work"), "--out", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("*-longtail-smoke.md")
    rows = [line.split(" | ") for line in report.read_text().splitlines() if line.startswith("| 1 |")]
    assert [r[1] for r in rows] == list(bench_longtail.ARMS)
    assert rows[0][4] == "1.000", "rounds is the baseline"
    train_batch = bench_longtail.SMOKE["trainer"]["train_batch"]
    assert all(float(r[9]) == train_batch for r in rows), "every arm trains train_batch groups per step"
    assert float(rows[0][11]) == 0 and float(rows[0][12]) == 0, "rounds carry and drop nothing"


def test_a_lone_longest_response_decodes_for_about_the_issue_figure():
    """7B on one H20: 20480 tokens one at a time, at the memory roofline (weights + the growing KV cache)."""
    setup = longtail_model.SETUPS[0]
    seconds = longtail_model.sum_decode_s(setup, 1, longtail_model.PROMPT, longtail_model.MAX_LEN)
    weights_only = longtail_model.MAX_LEN * 2 * setup.model.params / longtail_model.HBM_BYTES_S
    assert weights_only < seconds < 1.2 * weights_only  # ~78 s of weights plus ~5 s of KV reads


def test_both_engines_stream_so_the_bench_runs_their_arms():
    """engine_streams follows the engines' streaming contract: were open_stream renamed, the bench would name
    the vLLM engine as one without streaming and run nothing."""
    assert bench_longtail.engine_streams("torch") and bench_longtail.engine_streams("vllm")


def test_an_engine_without_streaming_is_named_in_one_line(tmp_path, capsys, monkeypatch):
    # The vLLM engine before it streamed.
    monkeypatch.setattr(bench_longtail, "engine_streams", lambda engine: engine == "torch")
    assert bench_longtail.main(["--engine", "vllm", "--work", str(tmp_path), "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().out.strip().count("\n") == 0 and not list(tmp_path.iterdir())

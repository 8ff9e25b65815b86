"""bench/bench_kernels.py --profile at the smoke shape: one torch.profiler trace per provider, holding the
trainer's range names (the provider's step, lm_head.forward and lm_head.backward inside)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `bench` is a top-level folder, not installed

from bench import bench_kernels  # noqa: E402


def trace_ranges(path: Path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return sorted(e["name"] for e in events if e.get("cat") == "user_annotation")


def test_profile_writes_one_trace_per_provider_with_the_trainers_range_names(tmp_path, capsys):
    # The command line: each provider measured, then profiled, in a process of its own.
    assert bench_kernels.main(["--device", "cpu", "--shapes", "smoke", "--providers", "torch-fused",
                               "--profile", str(tmp_path / "prof"), "--out", str(tmp_path / "out")]) == 0
    assert [p.name for p in (tmp_path / "prof" / "smoke").iterdir()] == ["torch-fused.pt.trace.json"]
    (report,) = (tmp_path / "out").glob("*.md")
    assert "| torch-fused | " in report.read_text()
    assert trace_ranges(tmp_path / "prof" / "smoke" / "torch-fused.pt.trace.json") == \
        sorted(["torch-fused", "lm_head.forward", "lm_head.backward"])
    # A child's profiling in this process, for three more providers: gemm-floor is the sweep's GEMMs alone
    # (no autograd), so a forward range only.
    _, n, hdim, vocab, dtype, _ = bench_kernels.SMOKE_SHAPE
    for provider, expected in (("naive", ["lm_head.forward", "lm_head.backward"]),
                               ("torch-50%", ["lm_head.forward", "lm_head.backward"]),
                               ("gemm-floor", ["lm_head.forward"])):
        trace = bench_kernels.trace_path(str(tmp_path / "prof"), "smoke", provider)
        bench_kernels.profile_provider(provider, n, hdim, vocab, dtype, "cpu", str(trace))
        assert trace_ranges(trace) == sorted([provider, *expected]), provider
    assert sorted(p.name for p in (tmp_path / "prof" / "smoke").iterdir()) == \
        ["gemm-floor.pt.trace.json", "naive.pt.trace.json", "torch-50pct.pt.trace.json", "torch-fused.pt.trace.json"]
    assert bench_kernels.trace_path("d", "CPU target, fp32", "naive") == Path("d/CPU-target/naive.pt.trace.json")

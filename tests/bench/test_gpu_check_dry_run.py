"""bench/gpu_check.py --dry-run: the GPU check's plumbing on a CPU (tiny shapes, impl="torch"), so that its
first run on a GPU cannot fail for a reason a CPU could have shown. Every section must report ok rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_gpu_check_dry_run_reports_every_section(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    sections = {r["section"] for r in rows}
    assert sections == {"environment", "gemm", "model", "providers", "profile", "tests"}, sections
    failed = [r for r in rows if str(r.get("status", "ok")).startswith(("failed", "skipped: 0"))]
    assert not failed, failed
    ran = {(r["shape"], r["provider"]) for r in rows if r["section"] == "providers" and r["status"] == "ok"}
    assert {("7B", "generic"), ("7B", "fused"), ("7B", "naive"), ("32B", "generic")} <= ran, ran
    assert all(r["fwd ms"] > 0 and r["bwd ms"] >= 0 for r in rows if r["section"] == "providers" and r["status"] == "ok")
    tests = next(r for r in rows if r["section"] == "tests")
    assert tests["status"] == "ok" and "collected" in tests["summary"], tests
    assert (tmp_path / "gpu_check.md").read_text().count("\n## ") == 6

"""bench/gpu_check.py --dry-run: the GPU check's plumbing on a CPU (tiny shapes, impl="torch"), so that its
first run on a GPU cannot fail for a reason a CPU could have shown. Every section must report ok rows, on the
image the check will meet: run here with the command line's package (tyro), the data's (pyarrow) and the GPU
extras (vllm, flash_attn, liger_kernel, cut_cross_entropy) impossible to import. yaml stays importable:
transformers itself needs it (flashdapo's own imports of the check do not: test_gpu_check_minimal_image.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ABSENT = ("tyro", "pyarrow", "vllm", "flash_attn", "liger_kernel", "cut_cross_entropy")
RUN_WITHOUT = """
import runpy, sys
for name in {absent!r}:
    sys.modules[name] = None  # an import of it raises ImportError
sys.argv = ["bench/gpu_check.py", "--dry-run", "--out", {out!r}]
runpy.run_path("bench/gpu_check.py", run_name="__main__")
"""


@pytest.mark.slow
def test_gpu_check_dry_run_reports_every_section(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    code = RUN_WITHOUT.format(absent=ABSENT, out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    missing = [line for line in (proc.stdout + proc.stderr).splitlines() if "ModuleNotFoundError" in line]
    assert not missing, missing
    rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    sections = {r["section"] for r in rows}
    assert sections == {"environment", "gemm", "model", "providers", "profile", "train", "tests"}, sections
    failed = [r for r in rows if str(r.get("status", "ok")).startswith(("failed", "skipped: 0"))]
    assert not failed, failed
    ran = {(r["shape"], r["provider"]) for r in rows if r["section"] == "providers" and r["status"] == "ok"}
    assert {("7B", "generic"), ("7B", "fused"), ("7B", "naive"), ("32B", "generic"), ("7B", "generic-cap30"),
            ("7B", "fused-cap30")} <= ran, ran
    assert all(r["fwd ms"] > 0 and r["bwd ms"] >= 0 for r in rows if r["section"] == "providers" and r["status"] == "ok")
    train = next(r for r in rows if r["section"] == "train")
    assert train["status"] == "ok" and train["steps"] == 2 and train["s/step"] > 0, train
    tests = {r["module"]: r for r in rows if r["section"] == "tests"}
    assert tests["(all)"]["status"] == "ok" and "skipped" in tests["(all)"]["summary"], tests
    assert tests["tests.kernels.test_kernels_cuda"]["status"] == "skipped", tests  # no GPU here
    assert (tmp_path / "gpu_check.md").read_text().count("\n## ") == 7

"""The GPU check runs on the image it will meet: torch, triton, transformers, numpy, safetensors and pytest
only. The dry run goes through every section in a process where the command line's package (tyro), the
data's (pyarrow) and the GPU extras (vllm, flash_attn, liger_kernel, cut_cross_entropy) cannot be imported,
and flashdapo's part of it imports without yaml too; the per-module test rows say what did not collect and
why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ABSENT = ("tyro", "yaml", "pyarrow", "vllm", "flash_attn", "liger_kernel", "cut_cross_entropy")
RUN_ABSENT = tuple(name for name in ABSENT if name != "yaml")
"""What the whole dry run runs without: yaml stays importable there, for transformers itself needs it
(huggingface_hub imports it); flashdapo's own imports of the check need none of ABSENT (the test below)."""

# Blocks the packages (an import raises ImportError) in this process only, then runs the check as a script.
RUN_BLOCKED = """
import runpy, sys
for name in {absent!r}:
    sys.modules[name] = None
sys.argv = ["bench/gpu_check.py", "--dry-run", "--out", {out!r}]
runpy.run_path("bench/gpu_check.py", run_name="__main__")
"""


@pytest.mark.slow
def test_the_dry_run_writes_its_rows_without_the_cli_and_gpu_extras(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    code = RUN_BLOCKED.format(absent=RUN_ABSENT, out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    broken = [line for line in (proc.stdout + proc.stderr).splitlines() if "ModuleNotFoundError" in line]
    assert not broken, broken
    rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    sections = {r["section"] for r in rows}
    assert {"environment", "gemm", "model", "providers", "profile", "tests"} <= sections, sections
    in_process = [r for r in rows if r["section"] != "train" and str(r.get("status", "ok")).startswith("failed")]
    assert not in_process, in_process


def test_the_gpu_check_and_its_imports_need_none_of_the_absent_packages():
    """Importing the check (and, through it, flashdapo's kernels, config and GPU table) with the packages
    blocked: what a GPU image without them meets first."""
    code = ("import sys\nfor n in %r: sys.modules[n] = None\nsys.path.insert(0, 'bench')\n"
            "import runpy; g = runpy.run_path('bench/gpu_check.py')\n"
            "import flashdapo.config, flashdapo.kernels, flashdapo.kernels.gpus, flashdapo.kernels.lm_head_choice\n"
            "print('imported')" % (ABSENT,))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-2000:]


def test_per_module_rows_say_what_did_not_collect(tmp_path):
    """pytest's JUnit XML read into one row per module: a collection error is 'not collected' with its cause,
    a module whose cases all skip is 'skipped', a failing case makes its module 'failed'."""
    sys.path.insert(0, str(ROOT))
    from bench.gpu_check import per_module

    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="" name="tests.vllm.test_real_vllm"><error message="collection failure">'
        "Traceback ...\nModuleNotFoundError: No module named 'vllm'</error></testcase>"
        '<testcase classname="tests.kernels.test_kernels_cuda" name="test_a"><skipped message="needs a GPU"/>'
        '</testcase>'
        '<testcase classname="tests.rollout.test_torch_engine" name="test_b"/>'
        '<testcase classname="tests.rollout.test_torch_engine" name="test_c"><failure message="boom"/></testcase>'
        '</testsuite></testsuites>')
    rows = per_module(xml)
    assert rows["tests.vllm.test_real_vllm"]["status"] == "not collected"
    assert "No module named 'vllm'" in rows["tests.vllm.test_real_vllm"]["summary"]
    assert rows["tests.kernels.test_kernels_cuda"]["status"] == "skipped"
    assert rows["tests.rollout.test_torch_engine"] == {"status": "failed", "passed": 1, "failed": 1, "skipped": 0,
                                                      "summary": ""}

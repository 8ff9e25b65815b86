"""The GPU check runs on the image it will meet: torch, triton, transformers, numpy, safetensors and pytest
only. Its imports (flashdapo's kernels, config and GPU table through it) need none of the command line's
packages (tyro, yaml), the data's (pyarrow) or the GPU extras; the whole dry run without them is
test_gpu_check_dry_run.py. The per-module test rows say what did not collect and why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABSENT = ("tyro", "yaml", "pyarrow", "vllm", "flash_attn", "liger_kernel", "cut_cross_entropy")


def test_the_gpu_check_and_its_imports_need_none_of_the_absent_packages():
    """Importing the check (and, through it, flashdapo's kernels, config and GPU table) with the packages
    blocked: what a GPU image without them meets first."""
    code = (f"import sys\nfor n in {ABSENT!r}: sys.modules[n] = None\nsys.path.insert(0, 'bench')\n"
            "import runpy; g = runpy.run_path('bench/gpu_check.py')\n"
            "import flashdapo.config, flashdapo.kernels, flashdapo.kernels.gpus, flashdapo.kernels.lm_head_choice\n"
            "print('imported')")
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

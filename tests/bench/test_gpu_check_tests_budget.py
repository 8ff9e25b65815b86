"""The GPU check's tests section (bench/gpu_check.py `cuda_tests`): it runs right after the environment, on the
test modules that mark CUDA cases only (not all of tests/ collected to deselect the rest), one pytest per module
under its own budget (--tests-budget-s), and names every module the budget left out. No GPU: the pytest
subprocesses and the clock are stand-ins."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import gpu_check  # noqa: E402

MARK = "pytest.mark." + "cuda"  # spelled apart: this module marks no case itself


def test_the_modules_with_cuda_cases_are_selected_own_marks_first(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "test_decorated.py").write_text(f"import pytest\n@{MARK}\ndef test_x(): pass\n")
    (tmp_path / "test_module_mark.py").write_text(f"import pytest\npytestmark = [{MARK}]\n")
    (tmp_path / "test_param.py").write_text(f"import pytest\nP = pytest.param(1, marks={MARK})\n")
    (tmp_path / "test_cpu.py").write_text("def test_y(): pass\n")
    (tmp_path / "helper_cuda.py").write_text(f"import pytest\n@{MARK}\ndef f(): pass\n")  # not a test module
    # the kernel suite's triton parameter, marked cuda on a GPU only
    (tmp_path / "test_kernel.py").write_text("from kernel_accuracy import TRITON, check\n")
    (tmp_path / "test_kernel_check_only.py").write_text("from kernel_accuracy import check\n")
    assert [p.relative_to(tmp_path).as_posix() for p in gpu_check.cuda_test_modules(tmp_path)] == \
        ["a/test_decorated.py", "test_module_mark.py", "test_param.py", "test_kernel.py"]
    # on a CPU (the dry run) the helper marks nothing: only the modules' own marks
    assert [p.name for p in gpu_check.cuda_test_modules(tmp_path, gpu=False)] == \
        ["test_decorated.py", "test_module_mark.py", "test_param.py"]
    real = [p.relative_to(ROOT).as_posix() for p in gpu_check.cuda_test_modules(ROOT / "tests")]
    assert real[0] == "tests/kernels/test_kernels_cuda.py" and "tests/kernels/test_targets_dtypes.py" in real
    assert "tests/models/moe/test_expert_parallel.py" not in real and __file__ not in real


def test_the_log_says_which_modules_started():
    log = ("============ test session starts ============\ntests/kernels/test_a.py ..s.  [ 40%]\n"
           "tests/rollout/test_b.py ..\n")
    assert gpu_check.started_modules(log, ["tests/kernels/test_a.py", "tests/rollout/test_b.py", "tests/c.py"]) \
        == ["tests/kernels/test_a.py", "tests/rollout/test_b.py"]


def test_the_tests_budget_is_the_timeout_and_a_timeout_names_what_was_left_out(tmp_path, monkeypatch):
    modules = [ROOT / "tests" / name for name in ("test_a.py", "test_b.py", "test_c.py")]
    monkeypatch.setattr(gpu_check, "cuda_test_modules", lambda _root, gpu: modules)
    ran = []

    def pytest_run(args, timeout, stdout, **_kw):  # test_a finishes, test_b is cut off, test_c never starts
        ran.append((args[-3:], timeout))
        stdout.write("tests/test_a.py ...\ntests/test_b.py ..")
        stdout.flush()
        raise gpu_check.subprocess.TimeoutExpired(args, timeout)

    monkeypatch.setattr(gpu_check.subprocess, "run", pytest_run)
    report = gpu_check.Report(tmp_path, deadline=gpu_check.time.monotonic() + 1000)  # the whole run: ample
    gpu_check.cuda_tests(report, dry=False, budget_s=110)
    assert ran == [(["tests/test_a.py", "tests/test_b.py", "tests/test_c.py"], 110)]
    rows = {r["module"]: r for r in map(json.loads, (tmp_path / "gpu_check.jsonl").read_text().splitlines())}
    assert rows["tests.test_a"]["status"] == "ran"
    assert rows["tests.test_b"]["status"] == "cut off by the tests budget"
    assert rows["tests.test_c"]["status"].startswith("left out")
    assert rows["(all)"]["status"].startswith("timeout (110 s")
    assert rows["(all)"]["summary"] == "left out (tests budget spent): tests/test_b.py, tests/test_c.py"
    # less of the whole run's budget left than the tests' own: the smaller
    gpu_check.cuda_tests(gpu_check.Report(tmp_path / "b", deadline=gpu_check.time.monotonic() + 60), False, 110)
    assert ran[-1][1] in (49, 50)  # 60 s less 10 s kept for the report


def test_the_tests_run_right_after_the_environment(monkeypatch, tmp_path):
    order = []
    monkeypatch.setattr(gpu_check, "run_section", lambda _report, name, _need, _fn: order.append(name))
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    assert gpu_check.main(["--out", str(tmp_path), "--tests-budget-s", "100"]) == 0
    assert order[:2] == ["environment", "tests"] and order.count("tests") == 1

"""Every Triton kernel of the package compiles for sm_90 (H100/H200/H20) at its shipped launch config,
without spilling registers and within Hopper's 227 KB of shared memory per block; no GPU needed
(Triton's compiler and the ptxas of its wheel do the work, in a subprocess without TRITON_INTERPRET)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HOPPER_SHARED_LIMIT = 227 * 1024
SCRIPT = Path(__file__).with_name("sm90_compile.py")


def _toolchain_missing() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton not installed"
    bin_dir = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin"
    return None if any(bin_dir.glob("ptxas*")) else f"no ptxas in the triton wheel ({bin_dir})"


@pytest.mark.skipif(_toolchain_missing() is not None, reason=str(_toolchain_missing()))
def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600,
                          cwd=SCRIPT.parents[2])
    assert proc.returncode == 0, f"compile failed:\n{proc.stderr[-3000:]}"
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert reports, "no kernel was compiled"
    for r in reports:
        assert r["arch"].startswith("sm_90"), r
        assert r["spill_bytes"] == 0, f"{r['kernel']} spills {r['spill_bytes']} bytes"
        assert r["shared_bytes"] <= HOPPER_SHARED_LIMIT, f"{r['kernel']} needs {r['shared_bytes']} B of shared memory"
        assert 0 < r["registers"] <= 255, r

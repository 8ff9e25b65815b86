"""Every Triton kernel of the package compiles for sm_90 (H100/H200/H20) at its shipped launch config, at
the run-time specialization (16-byte divisibility, as the JIT applies it at the real shapes) and without
it (ragged shapes): no register spills, within Hopper's 227 KB of shared memory per block, at least two
resident CTAs per SM, and 16-byte vector loads (and dz stores) where specialized. No GPU needed: Triton's
compiler and the ptxas of its wheel do the work, in a subprocess without TRITON_INTERPRET. `-s` prints
registers and CTAs per SM of each variant."""

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
        print(f"{r['kernel']:45s} specialized={r['specialized']!s:5s} registers {r['registers']:3d}  "
              f"CTAs/SM {r['ctas_per_sm']}  shared {r['shared_bytes']} B  ld.v{r['load_vector']} st.v{r['store_vector']}")
        assert r["arch"].startswith("sm_90"), r
        assert r["spill_bytes"] == 0, f"{r['kernel']} spills {r['spill_bytes']} bytes"
        assert r["shared_bytes"] <= HOPPER_SHARED_LIMIT, f"{r['kernel']} needs {r['shared_bytes']} B of shared memory"
        assert 0 < r["registers"] <= 255, r
        assert r["ctas_per_sm"] >= 2, f"{r['kernel']}: {r['ctas_per_sm']} CTA per SM cannot hide latency"
        if r["specialized"]:  # what runs at the real shapes: 16-byte accesses to the fp32 tile and to dz
            assert r["load_vector"] >= 4, f"{r['kernel']}: global loads of {r['load_vector']} element(s)"
            if r["kernel"].startswith("_grad_kernel"):
                assert r["store_vector"] >= 4, f"{r['kernel']}: dz stores of {r['store_vector']} element(s)"
    assert {r["specialized"] for r in reports} == {True, False}

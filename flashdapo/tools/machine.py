"""What machine a result came from, in one line: CPU model, core count, torch build.

Measured figures name their machine (benchmarks, the ablation reports): a CPU warm-up magnifies last-bit
differences between CPUs' floating-point kernels, so the same config and seed give another base model, and
other numbers, on another CPU (docs/ablation.md, "Measured panels").
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform.processor() elsewhere, possibly empty)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine_summary() -> str:
    """'<CPU model>; N CPUs; torch <version>'."""
    import torch

    return f"{cpu_name()}; {os.cpu_count()} CPUs; torch {torch.__version__}"

"""Profiling: named ranges shared by torch.profiler, NVTX and the step table (ranges.py), the profiler of
chosen training steps (step.py), the stage timer (stages.py), memory per stage (memory.py) and the table
(table.py)."""

from .ranges import RangeStats, Recorder, named, recording, traced
from .stages import StageTimer
from .step import StepProfiler

__all__ = ["RangeStats", "Recorder", "StageTimer", "StepProfiler", "named", "recording", "traced"]

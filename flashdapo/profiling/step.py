"""Profiling chosen training steps (the `profile` config section): a torch.profiler trace, the named ranges,
a table, and optionally memory, per profiled step and rank.

A profiled step on a profiled rank runs under torch.profiler (CPU activity, and CUDA on a GPU) with a
`ranges.Recorder` recording, so every stage the StageTimer times and the LM-head call inside the policy is
a named range in the trace, an NVTX range on CUDA (`nsys profile` shows the same names) and a row of the
table. On CUDA the step is also bracketed by cudaProfilerStart/Stop, so `nsys profile
--capture-range=cudaProfilerApi` records the profiled steps only. Files, in PROFILE_DIR (RUN_DIR/profile):

    rank<R>.<STEP>.pt.trace.json   Chrome trace JSON: chrome://tracing, https://ui.perfetto.dev, or
                                   `tensorboard --logdir PROFILE_DIR` with the torch-tb-profiler plugin,
                                   which reads this name as worker rank<R>, span <STEP>
    rank<R>.<STEP>.txt             the table (also printed by the lowest profiled rank)
    rank<R>.<STEP>.memory.pickle   with profile.memory on CUDA: the allocator's history (memory_viz)

Nothing here runs for a step that is not profiled, and `StepProfiler.configured` returns None when
profiling is off or this rank does not profile: no profiler object exists then.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from ..config import ProfileConfig
from ..errors import FlashdapoError, file_in_the_way
from . import ranges
from .memory import CudaMemoryHistory
from .ranges import Recorder
from .table import format_table, top_ops

STEP_RANGE = "step"
"""The range that holds a whole training step (the StageTimer's outermost stage)."""


class ProfileDirError(FlashdapoError, RuntimeError):
    """profile.dir cannot hold the profiles (a file, not writable); the message names it."""

    every_rank = False  # only the ranks that profile check it


def profiles(cfg: ProfileConfig, rank: int) -> bool:
    """Whether `rank` profiles any step."""
    return bool(cfg.steps) and (not cfg.ranks or rank in cfg.ranks)


def profile_dir(cfg: ProfileConfig, run_dir: Path) -> Path:
    """Where the profiles go: profile.dir, else RUN_DIR/profile."""
    return Path(cfg.dir) if cfg.dir else Path(run_dir) / "profile"


def check_profile_dir(cfg: ProfileConfig, run_dir: Path, rank: int) -> None:
    """On a rank that profiles, at the start of the run: create the profile directory and check it writable (a
    file is created and removed), so a wrong profile.dir is one line before any step, not a traceback at the
    profiled one. ProfileDirError naming it."""
    if not profiles(cfg, rank):
        return
    out_dir = profile_dir(cfg, run_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ProfileDirError(
            f"profile.dir={out_dir} is a file, not a directory; give a directory for the profiles "
            "of profile.steps (or leave profile.dir empty: RUN_DIR/profile)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir, prefix=".flashdapo-write-check-"):
            pass
    except (FileExistsError, NotADirectoryError) as err:
        raise ProfileDirError(
            f"profile.dir={out_dir}: cannot create it, {file_in_the_way(out_dir)} is a file, not a "
            "directory; choose another path") from err
    except OSError as err:
        raise ProfileDirError(
            f"profile.dir={out_dir}: cannot create or write it ({err.strerror or err}); fix its "
            "permissions or choose another path") from err


class StepProfiler:
    """Profiles `cfg.steps` on this rank, writing into `out_dir`."""

    def __init__(self, cfg: ProfileConfig, out_dir: Path, rank: int, device: torch.device, prints: bool):
        self.cfg, self.out_dir, self.rank, self.device, self.prints = cfg, out_dir, rank, device, prints

    @classmethod
    def configured(cls, cfg: ProfileConfig, run_dir: Path, rank: int,
                   device: torch.device) -> StepProfiler | None:
        """The profiler of this rank, or None when profiling is off or this rank is not among
        profile.ranks."""
        if not profiles(cfg, rank):
            return None
        return cls(cfg, profile_dir(cfg, run_dir), rank, device,
                   prints=rank == (min(cfg.ranks) if cfg.ranks else 0))

    def path(self, step: int, suffix: str) -> Path:
        return self.out_dir / f"rank{self.rank}.{step}{suffix}"

    @contextmanager
    def step(self, step: int) -> Iterator[Recorder | None]:
        """Profile the block when `step` is one of profile.steps (yielding its Recorder), else run it as
        is."""
        if step not in self.cfg.steps:
            yield None
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        cuda = self.device.type == "cuda"
        recorder = Recorder(self.device, rss=self.cfg.memory and not cuda)
        profiler = None
        with ExitStack() as stack:
            if self.cfg.torch_trace:
                activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                                       if cuda else [])
                profiler = stack.enter_context(torch.profiler.profile(activities=activities,
                                                                      profile_memory=self.cfg.memory))
            if self.cfg.memory and cuda:
                stack.enter_context(CudaMemoryHistory(self.path(step, ".memory.pickle")))
            if cuda:
                torch.cuda.profiler.start()
                stack.callback(torch.cuda.profiler.stop)
            stack.enter_context(ranges.recording(recorder))
            yield recorder
        self._write(step, recorder, profiler)

    def _write(self, step: int, recorder: Recorder, profiler) -> None:
        written = []
        ops = []
        device = self.device.type == "cuda"
        if profiler is not None:
            trace = self.path(step, ".pt.trace.json")
            profiler.export_chrome_trace(str(trace))
            written.append(trace)
            ops = top_ops(profiler, self.cfg.top_ops, device, recorder.names)
        if self.cfg.memory and device:
            written.append(self.path(step, ".memory.pickle"))
        table_path = self.path(step, ".txt")
        written.append(table_path)
        text = format_table(f"flashdapo: profile of step {step}, rank {self.rank}", recorder, STEP_RANGE, ops,
                            device, "written: " + ", ".join(str(p) for p in written))
        table_path.write_text(text + "\n")
        if self.prints:
            print(text, flush=True)

"""Config section of profiling training steps (`profile`): which steps and ranks, where the traces go,
and whether memory is recorded. The root of the tree is tree.py; the profiler is flashdapo/profiling/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from .checks import Check, PathStr, Positive, Section


@dataclass
class ProfileConfig(Section):
    """torch.profiler traces and a table of time per stage for chosen training steps (docs/gpu.md,
    "Profiling training steps"). Off (no steps) it makes no profiler object and adds no range."""

    steps: Annotated[list[int],
                     Check(lambda s: all(x >= 1 for x in s), "steps >= 1")] = field(default_factory=list)
    """Training steps to profile (e.g. 5 6); empty: off. Each profiled step writes, per profiled rank,
    PROFILE_DIR/rank<R>.<STEP>.pt.trace.json (Chrome/Perfetto JSON, named as the TensorBoard profiler
    plugin reads it) and rank<R>.<STEP>.txt, the table printed at the step's end: time per stage (the
    named ranges weight_sync, gen, reward, old_log_prob, adv, update_actor and, inside the update,
    lm_head.forward and lm_head.backward) and the top ops by self time."""
    ranks: Annotated[list[int], Check(lambda r: all(x >= 0 for x in r), "ranks >= 0")] = \
        field(default_factory=list)
    """Ranks that profile; empty: every rank. The lowest of them prints its table."""
    dir: PathStr = ""
    """Where the traces and tables go; '': RUN_DIR/profile."""
    memory: bool = False
    """Also record memory: on CUDA a snapshot of the allocator's history over the step
    (rank<R>.<STEP>.memory.pickle, for https://pytorch.org/memory_viz); on a CPU the peak resident set of
    each stage (a column of the table). Both add the per-op memory columns of the torch trace."""
    torch_trace: bool = True
    """Run torch.profiler over the step (the trace and the top-ops table). False: only the named ranges
    (NVTX on CUDA) and the stage times, for running under `nsys profile`, which records kernels itself and
    shares the GPU's tracing interface (CUPTI) with torch.profiler."""
    top_ops: Positive = 15
    """Rows of the table's top ops by self time."""

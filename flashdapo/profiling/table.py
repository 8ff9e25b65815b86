"""The short table of a profiled step: time per named range, then the top ops by self time."""

from __future__ import annotations

from dataclasses import dataclass

from .ranges import Recorder

OP_CHARS = 64
"""Op names are shown up to this many characters (a CUDA kernel's name can run to hundreds)."""


@dataclass(frozen=True)
class OpRow:
    """One op of the torch trace, summed over its calls in the step."""

    name: str
    calls: int
    self_ms: float
    self_device_ms: float


def top_ops(profiler, limit: int, device: bool, ranges: set[str]) -> list[OpRow]:
    """The `limit` ops with the most self time (device time when `device`, else CPU time); the named
    `ranges` themselves are left out (their self time is only the gaps between the ops they hold)."""
    rows = [OpRow(e.key, e.count, e.self_cpu_time_total / 1e3, e.self_device_time_total / 1e3)
            for e in profiler.key_averages() if e.key not in ranges]
    rows.sort(key=lambda r: r.self_device_ms if device else r.self_ms, reverse=True)
    return rows[:limit]


def format_table(title: str, recorder: Recorder, step_range: str, ops: list[OpRow], device: bool,
                 trace_note: str) -> str:
    """The table as text: one row per range under the ranges that held it, in the order they first opened,
    indented by nesting (seconds, calls, share of `step_range`; peak resident set when recorded), then the
    op rows."""
    total = recorder.seconds(step_range) or 1e-9
    rss = any(r.peak_rss for r in recorder.rows.values())
    head = f"  {'range':<22} {'seconds':>9} {'calls':>6} {'share':>7}" + (f" {'peak RSS MiB':>13}"
                                                                          if rss else "")
    lines = [title, head]
    for path, row in recorder.rows.items():
        label = "  " * (len(path) - 1) + path[-1]
        line = f"  {label:<22} {row.seconds:>9.3f} {row.calls:>6} {100 * row.seconds / total:>6.1f}%"
        lines.append(line + (f" {row.peak_rss / 2**20:>13.1f}" if rss else ""))
    if ops:
        kind = "device" if device else "CPU"
        width = min(max(len(op.name) for op in ops), OP_CHARS)
        lines += ["", f"  top ops by self {kind} time", f"  {'op':<{width}} {'calls':>6} {'self ms':>9}"
                  + (f" {'CPU ms':>9}" if device else "")]
        for op in ops:
            ms = op.self_device_ms if device else op.self_ms
            name = op.name if len(op.name) <= width else op.name[:width - 3] + "..."
            lines.append(f"  {name:<{width}} {op.calls:>6} {ms:>9.2f}" +
                         (f" {op.self_ms:>9.2f}" if device else ""))
    if trace_note:
        lines += ["", f"  {trace_note}"]
    return "\n".join(lines)

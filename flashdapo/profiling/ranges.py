"""Named ranges: one name per stage of a training step, seen alike by torch.profiler, Nsight Systems and the
step's table.

While a `Recorder` is recording (a profiled step, `recording`), every `named(name)` block is a
`torch.profiler.record_function` range (a `user_annotation` in the torch trace), on CUDA also an NVTX range
(`nsys profile` shows it in its NVTX row), and its wall time (with the device synchronized at its end, so
that queued GPU work counts where it was issued) and call count go to the recorder; with `rss`, the peak
resident set inside it too. `traced(name, fn, ...)` names a differentiable call twice: `<name>.forward`
around the call and `<name>.backward` around its backward (from the gradient reaching its outputs to the
gradient leaving its inputs), through two identity autograd functions.

Not recording (the default, every step that is not profiled), `named` returns one shared null context
and `traced` calls `fn` directly: no profiler object, range or synchronization.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from .memory import RssPeaks

_OFF = nullcontext()
_active: Recorder | None = None


@dataclass
class RangeStats:
    """One row of a profiled step's table: a range name under the ranges that held it."""

    seconds: float = 0.0
    calls: int = 0
    peak_rss: int = 0
    """Bytes: the largest resident set inside any of its calls (with rss; else 0)."""


class Recorder:
    """Time, calls and (with `rss`) peak resident set per range, over one profiled step. Rows are keyed by
    the path of open ranges (('step', 'update_actor', 'lm_head.forward')): the same call under two stages
    is two rows; they are kept in the order they first opened."""

    def __init__(self, device: torch.device, rss: bool = False):
        self.cuda = device.type == "cuda"
        self.rows: dict[tuple[str, ...], RangeStats] = {}
        self._open: list[str] = []
        self._rss = RssPeaks() if rss else None

    @property
    def names(self) -> set[str]:
        """Every range name recorded."""
        return {path[-1] for path in self.rows}

    def seconds(self, name: str) -> float:
        """Total seconds of range `name`, wherever it opened (nested calls of a name not counted twice)."""
        return sum(r.seconds for path, r in self.rows.items() if path[-1] == name and name not in path[:-1])

    def enter(self, name: str) -> tuple[tuple[str, ...], Any, float]:
        """Open range `name`; returns the token `exit` takes."""
        path = (*self._open, name)
        self.rows.setdefault(path, RangeStats())
        self._open.append(name)
        scope = torch.autograd.profiler.record_function(name)
        scope.__enter__()
        if self.cuda:
            torch.cuda.nvtx.range_push(name)
        if self._rss is not None:
            self._rss.enter()
        return path, scope, time.perf_counter()

    def exit(self, token: tuple[tuple[str, ...], Any, float]) -> None:
        path, scope, start = token
        if self.cuda:
            torch.cuda.synchronize()  # deliberate, in profiled steps only: the range's GPU work counts in it
            torch.cuda.nvtx.range_pop()
        scope.__exit__(None, None, None)
        self._open.pop()
        row = self.rows[path]
        row.seconds += time.perf_counter() - start
        row.calls += 1
        if self._rss is not None:
            row.peak_rss = max(row.peak_rss, self._rss.exit())


class _Range:
    def __init__(self, recorder: Recorder, name: str):
        self.recorder, self.name = recorder, name

    def __enter__(self) -> None:
        self.token = self.recorder.enter(self.name)

    def __exit__(self, *exc: object) -> None:
        self.recorder.exit(self.token)


def named(name: str):
    """A context naming its block `name` while a step is profiled; a shared null context otherwise."""
    return _OFF if _active is None else _Range(_active, name)


def active() -> Recorder | None:
    """The recorder of the profiled step running now, if any."""
    return _active


@contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Make `recorder` the one `named` and `traced` report to while the block runs."""
    global _active
    previous, _active = _active, recorder
    try:
        yield recorder
    finally:
        _active = previous


class _Span:
    """The backward range of one traced call, opened by _BackwardStarts and closed by _BackwardEnds."""

    def __init__(self, recorder: Recorder, name: str):
        self.recorder, self.name, self.token = recorder, name, None

    def open(self) -> None:
        if self.token is None:
            self.token = self.recorder.enter(self.name)

    def close(self) -> None:
        if self.token is not None:
            self.recorder.exit(self.token)
            self.token = None


class _BackwardEnds(torch.autograd.Function):
    """Identity on a call's inputs; its backward runs once their gradients are formed: the span closes."""

    @staticmethod
    def forward(ctx, span: _Span, *inputs: torch.Tensor):
        ctx.span = span
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.span.close()
        return (None, *grads)


class _BackwardStarts(torch.autograd.Function):
    """Identity on a call's outputs; its backward runs when their gradients arrive: the span opens. Copies,
    not views: the outputs may leave an FSDP2 module, which must not return views (they are per-token
    vectors or a scalar, and this runs in profiled steps only)."""

    @staticmethod
    def forward(ctx, span: _Span, *outputs: torch.Tensor):
        ctx.span = span
        return tuple(x.clone() for x in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.span.open()
        return (None, *grads)


def traced(name: str, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], *args: Any) -> Any:
    """`fn(*inputs, *args)`, named `<name>.forward`, and its backward named `<name>.backward` (when a gradient
    flows through it). `fn` returns a tensor or a tuple of tensors and Nones. Not recording: `fn` alone."""
    recorder = _active
    if recorder is None:
        return fn(*inputs, *args)
    span = _Span(recorder, f"{name}.backward")
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        inputs = _BackwardEnds.apply(span, *inputs)
    with _Range(recorder, f"{name}.forward"):
        out = fn(*inputs, *args)
    outputs = out if isinstance(out, tuple) else (out,)
    live = [i for i, x in enumerate(outputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not live:
        return out
    marked = list(outputs)
    for i, x in zip(live, _BackwardStarts.apply(span, *(outputs[i] for i in live))):
        marked[i] = x
    return tuple(marked) if isinstance(out, tuple) else marked[0]

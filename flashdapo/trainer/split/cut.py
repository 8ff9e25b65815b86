"""Split placement's checkpoint: a consistent cut of both sides, so a resume continues bitwise.

The trainer's checkpoint of step c (checkpoint.py, unchanged) holds θ(c) and its optimizer, schedule and RNG.
The rollout side is further on: by the schedule it generates batch c+1 .. c+k with weights older than θ(c),
which a resumed run could not regenerate. So the rollout side writes the other part of the cut when it
reaches the boundary after batch min(c + k, total_steps), in `RUN_DIR/split_rollout/part_XXXXXXXX/`:

- `queue.pt` (rollout rank 0): the packed batches c+1 .. min(c + k, total_steps), as sent;
- `rank<r>.pt` (each rollout rank): its prompt sampler's position, its rounds surplus (informative groups
  past the last target) or its streaming state (carried responses, waiting groups, queue), at that boundary;
- `COMPLETE`, written by rollout rank 0 once every rollout rank's file is in, then the directory renamed
  into place.

A trainer checkpoint is resumable in split placement only with its part complete (`require_part`: else it
is skipped for an older one, as a damaged checkpoint is). The resumed trainer trains the queued batches
first; the rollout side restores its state and continues at batch min(c + k, total_steps) + 1 with θ(c),
which is exactly what the schedule gives that batch. (A run resumed with a larger trainer.total_steps than the
one that wrote the cut continues after that run's last batch; batches the schedule would have given older
weights than θ(c) get θ(c), as at a fresh start.) A checkpoint written on a stop (Ctrl-C, SIGTERM) at a
step that is no save step gets no part: the resume falls back to the newest one that has.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ...distributed.collectives import barrier
from ..state.checkpoint import CheckpointError, load_failure, write_failure
from .wire import unpack

PARTS = "split_rollout"
KEEP_PARTS = 4
"""Rollout parts kept (the newest): more than the trainer's checkpoints ever need at the default keep_last."""


def part_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / PARTS / f"part_{step:08d}"


def save_steps(cfg, start: int) -> list[int]:
    """The trainer's checkpoint steps after `start` that are known in advance: every save_every, and the
    last."""
    total, every = cfg.trainer.total_steps, cfg.checkpoint.save_every
    return [c for c in range(start + 1, total + 1) if c == total or (every and c % every == 0)]


def parts_due(batch: int, cfg, start: int) -> list[int]:
    """The checkpoint steps whose rollout part is written at the boundary after `batch`."""
    total, k = cfg.trainer.total_steps, cfg.rollout.max_lag
    return [c for c in save_steps(cfg, start) if min(c + k, total) == batch]


RUN_ID = "RUN_ID"
"""A part's file naming the run that wrote it (the trainer's run id): a resume takes only its own run's
parts."""


def write_part(run_dir: Path, step: int, boundary: int, rank: int, state: dict[str, Any],
               queue: list[bytes] | None, run_id: str | None = None) -> None:
    """Every rollout rank: its state after batch `boundary` for the cut of `step`; rank 0 also the queued
    batches step+1 .. boundary and the run's id, then publishes."""
    final = part_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    with _writing(final, tmp):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    barrier()
    with _writing(final, tmp):
        torch.save(state, tmp / f"rank{rank}.pt")
        if queue is not None:
            torch.save([torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in queue], tmp / "queue.pt")
    barrier()
    if rank == 0:
        with _writing(final, tmp):
            if run_id:
                (tmp / RUN_ID).write_text(run_id)
            (tmp / "COMPLETE").write_text(json.dumps({"step": step, "boundary": boundary}))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        _prune(run_dir)


@contextmanager
def _writing(final: Path, tmp: Path) -> Iterator[None]:
    """A failed write of the part (a full disk: torch's writer says only "unexpected pos") is one line naming
    the part and the reason; its temporary directory is removed (never published: the job stops, and no rank
    passes the next barrier)."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        reason = write_failure(err, tmp.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"cannot write {final} (the rollout side's part of the cut of step "
            f"{int(final.name.rsplit('_', 1)[1])}): {reason}. The trainer's checkpoints are intact; "
            "free disk space (or fix the error), then continue with --checkpoint.resume auto (it "
            "resumes from the newest checkpoint whose part is complete)") from err


def _prune(run_dir: Path) -> None:
    parts = sorted(p for p in (Path(run_dir) / PARTS).glob("part_*") if not p.name.endswith(".tmp"))
    for old in parts[:-KEEP_PARTS]:
        shutil.rmtree(old, ignore_errors=True)


def cut_dir(checkpoint: Path) -> Path:
    """The run dir whose parts complete `checkpoint` (RUN_DIR/checkpoints/step_XXXXXXXX): the checkpoint's
    own, also when it is resumed into another run dir (--checkpoint.resume PATH)."""
    return Path(checkpoint).parent.parent


def require_part(run_dir: Path, step: int, checkpoint: Path, run_id: str | None = None) -> None:
    """Refuse (skip) a checkpoint whose rollout part is not complete, is another run's, or does not load: its
    marker, its run id, each queued batch, each rollout rank's state (read as the resume reads them; a file
    flashdapo did not write is named)."""
    part = part_dir(run_dir, step)
    if not (part / "COMPLETE").is_file():
        raise CheckpointError(f"{checkpoint.name}: the rollout side's part of this cut ({part}) is "
                              "missing: the rollout side had not reached its boundary when the run stopped")
    owner = (part / RUN_ID).read_text().strip() if (part / RUN_ID).is_file() else None
    if run_id and owner and owner != run_id:
        raise CheckpointError(
            f"{checkpoint.name}: the rollout side's part of this cut ({part}) was written by run "
            f"{owner}, not by this checkpoint's run {run_id}: another run's files are in "
            f"{run_dir}; move {part.parent} aside (the resume then takes an older checkpoint)")
    read_boundary(run_dir, step)
    read_queue(run_dir, step)
    for file in sorted(part.glob("rank*.pt")):
        _load(file, "the rollout side's state")


def read_boundary(run_dir: Path, step: int) -> int:
    """The last batch the cut of `step` queued (a run that ended at `step` queued none: `step` itself)."""
    try:
        return int(json.loads((part_dir(run_dir, step) / "COMPLETE").read_text())["boundary"])
    except Exception as err:
        raise CheckpointError(f"{part_dir(run_dir, step)}: unreadable COMPLETE marker ({err})") from err


def _load(path: Path, what: str) -> Any:
    """torch.load(weights_only=True) of a part's file; CheckpointError naming it and why it does not load."""
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing ({what}); remove {path.parent} (the resume then takes an older "
            "checkpoint)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a pickled object, a truncated zip, an I/O error
        raise CheckpointError(
            f"{path} ({what}): {load_failure(err)}; remove {path.parent} (the resume then takes "
            "an older checkpoint)") from err


def read_queue(run_dir: Path, step: int) -> list[bytes]:
    """The packed batches queued at the cut of `step`, in order; each is unpacked once here, so a batch that
    does not read back (a file flashdapo did not write) is refused at the resume, not when its step comes."""
    path = part_dir(run_dir, step) / "queue.pt"
    tensors = _load(path, "the queued batches")
    if not isinstance(tensors, list) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise CheckpointError(
            f"{path}: not a file flashdapo wrote, or a corrupted one (expected a list of byte "
            f"tensors, got {type(tensors).__name__}); remove {path.parent} (the resume then takes "
            "an older checkpoint)")
    payloads = [t.numpy().tobytes() for t in tensors]
    for i, payload in enumerate(payloads):
        try:
            unpack(payload)
        except Exception as err:
            raise CheckpointError(
                f"{path}: queued batch {step + 1 + i}: {load_failure(err)}; remove {path.parent} "
                "(the resume then takes an older checkpoint)") from err
    return payloads


def read_rank_state(run_dir: Path, step: int, rank: int) -> dict[str, Any]:
    path = part_dir(run_dir, step) / f"rank{rank}.pt"
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing (the state of rollout rank {rank}); was the run split over another "
            "number of rollout ranks?")
    return _load(path, "the rollout side's state")


__all__ = ["cut_dir", "part_dir", "parts_due", "read_boundary", "read_queue", "read_rank_state",
           "require_part", "save_steps", "write_part"]

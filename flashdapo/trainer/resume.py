"""Resuming a run honestly: only this run's checkpoints, only with the settings it was trained with.

- **Which checkpoint.** A run directory holds one run, named by the id in its `run.json` (rundir.py).
  `--checkpoint.resume auto` takes the newest complete checkpoint: if its COMPLETE marker names another run
  (a checkpoint copied into checkpoints/) the resume is refused with one line; another run's checkpoints older
  than this run's newest are skipped with a warning. A damaged checkpoint is not another run's: a marker
  that does not parse names no run, so it is not judged here, and loading skips it (checkpoint.py) for the
  newest one of this run that loads. A directory without run.json (a new one, or one written by an older
  flashdapo) adopts the run of the newest readable marker. `--checkpoint.resume PATH` of another run than
  the directory's is refused too: resume it in a run directory of its own.
- **Same settings.** Each checkpoint records the settings that shape the run (run_settings.py); a resume
  with other settings is refused naming each `old -> new`, unless `checkpoint.allow_changes` accepts them.
- **Optimizer settings are this run's.** The restored optimizer and LR schedule take this run's `optim`
  section: lr (through the schedule's base rate, so the current warmup factor applies to the new rate),
  betas, eps and weight decay. Unchanged settings give the checkpoint's rates exactly (bitwise resume).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import Config, OptimConfig
from .checkpoint import TrainerState, load_first_loadable, marker_run_id
from .distributed import DistEnv
from .run_settings import ResumeRefused, compare_settings, describe_changes


@dataclass
class Resumed:
    """The checkpoint a run continues from, and what it accepted."""

    path: Path
    state: TrainerState
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    """Settings changed from the checkpoint's, accepted by checkpoint.allow_changes: (field, old, new)."""


def own_checkpoints(candidates: list[Path], dir_run_id: str | None, explicit: bool,
                    warn: Callable[[str], None]) -> list[Path]:
    """The candidates (newest first) this run may resume from (module docstring); ResumeRefused if the one
    it would take belongs to another run. Damaged ones (their marker names no run) are kept for loading to
    skip, with a line saying what is wrong."""
    ids = {path: marker_run_id(path) for path in candidates}
    readable = [path for path in candidates if ids[path] is not None]
    if not readable:
        return candidates
    newest, newest_id = readable[0], ids[readable[0]]
    owner = dir_run_id if dir_run_id is not None else newest_id
    if newest_id != owner:
        which = "newest checkpoint" if newest is candidates[0] else "newest checkpoint with a readable marker"
        what = f"checkpoint {newest}" if explicit else f"the {which}, {newest},"
        fix = ("resume it in a run directory of its own (an empty --logging.run-dir)" if explicit else
               "move it out of checkpoints/ (or resume it in a run directory of its own, with "
               "--checkpoint.resume PATH)")
        raise ResumeRefused(f"{what} belongs to run {newest_id or '(unrecorded)'}, but this run directory holds run "
                            f"{owner} (its run.json); resuming it would splice two runs: {fix}")
    foreign = [path for path in readable if ids[path] != owner]
    if foreign:
        warn(f"warning: skipping {len(foreign)} checkpoint(s) of another run in checkpoints/ "
             f"({', '.join(p.name for p in foreign)}): resume auto only continues this run ({owner})")
    return [path for path in candidates if path not in foreign]


def load_resume(candidates: list[Path], cfg: Config, settings: dict[str, Any], env: DistEnv, model,
                optimizer, warn: Callable[[str], None]) -> Resumed | None:
    """Load the first candidate that loads, refusing it (before its weights load) when its recorded settings
    differ from `settings` beyond checkpoint.allow_changes."""
    accepted: list[tuple[str, Any, Any]] = []

    def check(state: TrainerState, path: Path) -> None:
        if not state.settings:
            warn(f"warning: {path} records no run settings (written by an older flashdapo): model, data, "
                 "batch and optimizer settings cannot be checked against it")
        accepted[:] = compare_settings(state.settings, settings, cfg.checkpoint.allow_changes, path)

    loaded = load_first_loadable(candidates, env, model, optimizer, warn, check=check)
    if loaded is None:
        return None
    return Resumed(path=loaded[0], state=loaded[1], changes=accepted)


def apply_optim_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                       oc: OptimConfig) -> float:
    """Give a restored optimizer and LambdaLR schedule this run's optim settings; returns the lr now in use.

    The optimizer's state dict restores the checkpoint's hyper-parameters and the schedule its base rates, so
    a changed optim.lr would otherwise be ignored. The rate is recomputed as the schedule computes it,
    base_lr * lambda(last_epoch): for an unchanged lr it is the checkpoint's rate, bit for bit."""
    scheduler.base_lrs = [oc.lr for _ in optimizer.param_groups]
    for group, lmbda in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group.update(initial_lr=oc.lr, lr=oc.lr * lmbda(scheduler.last_epoch), betas=tuple(oc.betas), eps=oc.eps,
                     weight_decay=oc.weight_decay)
    # get_last_lr() (the loop's actor/lr) reads this private copy, which the schedule refreshes only in step().
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return optimizer.param_groups[0]["lr"]


def describe_resume(resumed: Resumed, lr: float, allowed: list[str]) -> str:
    """The log line of a resume: where, which step and run, the lr in use, and any accepted change."""
    line = f"resumed from {resumed.path} at step {resumed.state.step} (run {resumed.state.run_id}); lr {lr:.6g}"
    if resumed.changes:
        line += (f"; settings changed from the checkpoint's (checkpoint.allow_changes={' '.join(allowed)}): "
                 f"{describe_changes(resumed.changes)}")
    return line


__all__ = ["Resumed", "ResumeRefused", "apply_optim_config", "describe_resume", "load_resume", "own_checkpoints"]

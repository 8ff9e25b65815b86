"""Resuming a run honestly: only this run's checkpoints, only with the settings it was trained with.

- **Which checkpoint.** A run directory holds one run, named by the id in its `run.json` (rundir.py) and in
  each checkpoint's COMPLETE marker. `--checkpoint.resume auto` takes the newest complete checkpoint, once
  the markers agree: checkpoints of two runs in checkpoints/ (one copied in, or run.json lost), or of
  another run than run.json's, are refused in one line naming each run and its checkpoints, with or without
  run.json, since nothing could tell which of them to continue. A damaged checkpoint is not another
  run's: a marker that does not parse names no run, so it is not judged here, and loading skips it
  (checkpoint.py) for the newest one of this run that loads. A directory without run.json (a new one, or one
  written by an older flashdapo) adopts the one run its markers name. `--checkpoint.resume PATH` of
  another run than the directory's is refused too: resume it in a run directory of its own.
- **Which prompts next.** The checkpoint's position in the prompt order continues, unless an accepted change
  gave the run other data or another order (data.train_files, trainer.seed, data.shuffle, ...): the order
  then restarts over this run's data, said in one line.
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

from ...config import Config, OptimConfig
from ...data import PromptSampler
from ...distributed.mesh import DistEnv
from .checkpoint import StateCheck, TrainerState, load_first_loadable, marker_run_id
from .run_settings import ResumeRefused, compare_settings, describe_changes

_ORDER_KEYS = ("num_prompts", "seed", "shuffle")
"""What fixes the prompt order besides the data (PromptSampler.state_dict)."""


@dataclass
class Resumed:
    """The checkpoint a run continues from, and what it accepted."""

    path: Path
    state: TrainerState
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    """Settings changed from the checkpoint's, accepted by checkpoint.allow_changes: (field, old, new)."""


def own_checkpoints(candidates: list[Path], dir_run_id: str | None, explicit: bool) -> list[Path]:
    """The candidates (newest first) this run may resume from (module docstring): ResumeRefused when the
    readable markers name more than one run, or another run than the directory's run.json. Damaged ones
    (their marker names no run) are kept for loading to skip, with a line saying what is wrong."""
    ids = {path: marker_run_id(path) for path in candidates}
    runs: dict[str, list[str]] = {}
    for path in candidates:
        if ids[path] is not None:
            runs.setdefault(ids[path], []).append(path.name)
    if not runs:
        return candidates
    if explicit:
        (path,), (run,) = candidates, runs
        if dir_run_id is not None and run != dir_run_id:
            raise ResumeRefused(
                f"checkpoint {path} belongs to run {run or '(unrecorded)'}, but this run directory "
                f"holds run {dir_run_id} (its run.json); resuming it would splice two runs: resume it "
                "in a run directory of its own (an empty --logging.run-dir)")
        return candidates
    if len(runs) > 1 or (dir_run_id is not None and dir_run_id not in runs):
        named = "; ".join(f"run {run or '(unrecorded)'}: {', '.join(names)}" for run, names in runs.items())
        record = (f"its run.json records run {dir_run_id}" if dir_run_id is not None else
                  "no run.json says which run this directory holds")
        raise ResumeRefused(
            f"{candidates[0].parent} holds checkpoints of {len(runs)} run(s) ({named}) and {record}; "
            "resuming would splice two runs: move the other run's checkpoints out of checkpoints/ (or "
            "resume one of them with --checkpoint.resume PATH in a run directory of its own)")
    return candidates


def restore_sampler(sampler: PromptSampler, resumed: Resumed, log: Callable[[str], None]) -> None:
    """Continue the checkpoint's position in the prompt order, unless an accepted change (data.*,
    trainer.seed) gave this run other data or another order: the order then restarts at the first prompt of
    this run's data, said in one line. Without such a change a different order is refused (DataError)."""
    state, mine = resumed.state.sampler, sampler.state_dict()
    differ = [key for key in _ORDER_KEYS if key in state and state[key] != mine[key]]
    new_data = [
        p for p, _, _ in resumed.changes
        if p in ("data.train_files", "data.task") or p.count(".") >= 2 and p.startswith("data.")
    ]
    accepted = [p for p, _, _ in resumed.changes if p.startswith("data.") or p == "trainer.seed"]
    if not accepted or not (differ or new_data):
        sampler.load_state_dict(state)
        return
    log(f"{', '.join(accepted)} changed (checkpoint.allow_changes): the prompt order restarts at the first "
        "prompt of "
        f"this run's data ({mine['num_prompts']} prompts) instead of the checkpoint's position (epoch "
        f"{state.get('epoch')}, prompt {state.get('position')} of {state.get('num_prompts', '?')})")


def load_resume(candidates: list[Path], cfg: Config, settings: dict[str, Any], env: DistEnv, model,
                optimizer, warn: Callable[[str], None], also: StateCheck | None = None) -> Resumed | None:
    """Load the first candidate that loads, refusing it (before its weights load) when its recorded settings
    differ from `settings` beyond checkpoint.allow_changes. `also`: a further check (a CheckpointError from
    it skips the candidate for an older one)."""
    accepted: list[tuple[str, Any, Any]] = []

    def check(state: TrainerState, path: Path) -> None:
        if not state.settings:
            warn(f"warning: {path} records no run settings (written by an older flashdapo): model, data, "
                 "batch and optimizer settings cannot be checked against it")
        accepted[:] = compare_settings(state.settings, settings, cfg.checkpoint.allow_changes, path)
        if also is not None:
            also(state, path)

    loaded = load_first_loadable(candidates, env, model, optimizer, warn, check=check)
    if loaded is None:
        return None
    return Resumed(path=loaded[0], state=loaded[1], changes=accepted)


def apply_optim_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                       oc: OptimConfig, lr: float) -> float:
    """Give a restored optimizer and LambdaLR schedule this run's optim settings; returns the lr now in use.

    The optimizer's state dict restores the checkpoint's hyper-parameters and the schedule its base rates, so
    a changed optim.lr would otherwise be ignored. `lr` is the peak rate (Config.peak_lr). The rate is
    recomputed as the schedule computes it, base_lr * lambda(last_epoch): for an unchanged lr it is the
    checkpoint's rate, bit for bit."""
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, lmbda in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group.update(initial_lr=lr, lr=lr * lmbda(scheduler.last_epoch), betas=tuple(oc.betas),
                     eps=oc.eps, weight_decay=oc.weight_decay)
    # get_last_lr() (the loop's actor/lr) reads this private copy, which the schedule refreshes only in
    # step().
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return optimizer.param_groups[0]["lr"]


def describe_resume(resumed: Resumed, lr: float, allowed: list[str]) -> str:
    """The log line of a resume: where, which step and run, the lr in use, and any accepted change."""
    state = resumed.state
    line = f"resumed from {resumed.path} at step {state.step} (run {state.run_id}); lr {lr:.6g}"
    if resumed.changes:
        line += (f"; settings changed from the checkpoint's (checkpoint.allow_changes={' '.join(allowed)}): "
                 f"{describe_changes(resumed.changes)}")
    return line


__all__ = [
    "Resumed", "ResumeRefused", "apply_optim_config", "describe_resume", "load_resume", "own_checkpoints",
    "restore_sampler"
]

"""Checkpoints that survive a crash (the final HF export is export.py).

A checkpoint is a directory `checkpoints/step_XXXXXXXX/` holding a `torch.distributed.checkpoint`
(DCP) save of model + optimizer (sharded, so it reloads at any world size and any trainer.expert_parallel: a
MoE layer's experts are DTensors of the whole [num_experts, ...] tensors, models/moe/), `trainer_state.pt`
(step, run id, LR schedule, data position, the run's settings: run_settings.py), one `rng_rank{r}.pt` per rank
(torch, CUDA, numpy, python), and a `COMPLETE` marker (JSON: step, world size, run id). It is written
under `step_XXXXXXXX.tmp/` and renamed into place only once every rank has finished and rank 0 sees every
rank's files (where nodes do not share the run directory, a rank's shards land on its own disk: refused),
so a crash mid-save never leaves a directory that `--resume auto` would pick; a failed save (a full disk)
removes its temporary directory and leaves every older checkpoint as it was.

`trainer_state.pt`, the RNG files and the per-rank states (`stream_rank<r>.pt`) hold only tensors, numbers,
strings, lists and dicts, and are read with `torch.load(weights_only=True)`: loading a checkpoint never
unpickles arbitrary objects (a crafted file cannot run code; it is named as not a file flashdapo wrote).
`--resume auto` tries the complete checkpoints newest first and resumes from the first that loads, warning
about each one it skips (resume.py decides which run's checkpoints qualify and checks the settings). A damaged
checkpoint (a file missing or truncated, a marker that does not parse, as a failing disk or a half-finished
copy leaves them; any of its files, this rank's state included) is one that does not load: it is skipped with
a line naming it and what is wrong. A write that fails for a full disk says so (torch's own writer reports
only "unexpected pos"). Weights holding NaN or inf are never saved.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import re
import resource
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ...distributed.collectives import all_gather_objects, all_reduce, barrier
from ...distributed.interrupt import interruption_of
from ...distributed.mesh import DistEnv
from ...errors import FlashdapoError, refused_pickle
from ...models.lora import layout_of, trained

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
StateCheck = Callable[["TrainerState", Path], None]
"""Called with a checkpoint's state before its weights load; raises to refuse it."""


class CheckpointError(FlashdapoError, RuntimeError):
    """A checkpoint that cannot be written or resumed from; the message says why and what to do."""


@dataclass
class TrainerState:
    """Everything besides weights and optimizer that a resumed run needs to continue identically."""

    step: int
    scheduler: dict[str, Any]
    sampler: dict[str, Any]
    run_id: str = ""
    """The run that wrote the checkpoint (see rundir.py); pruning only touches this run's checkpoints."""
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The settings that shaped the run (run_settings.py), compared on resume; empty in older checkpoints."""
    totals: dict[str, int] = dataclasses.field(default_factory=dict)
    """The run's cumulative counts (run.RunTotals as a dict); empty in older checkpoints (counted from 0)."""

    @classmethod
    def from_plain(cls, data: Any, where: Path) -> TrainerState:
        """Rebuild from the plain dict stored in trainer_state.pt; CheckpointError if it is not one."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or not {"step", "scheduler", "sampler"} <= set(data) <= names:
            raise CheckpointError(f"{where}: expected a dict with keys {sorted(names)}, got "
                                  f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        return cls(**data)


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def _root(err: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (which wraps each with its traceback)."""
    if isinstance(err, CheckpointException) and err.failures:
        return _root(next(iter(err.failures.values()))[0])
    return err


def one_line(err: BaseException) -> str:
    """`Type: message` of the root failure, on one line."""
    err = _root(err)
    text = "".join(traceback.format_exception_only(type(err), err)).strip().splitlines()
    return text[-1] if text else type(err).__name__


FULL_BELOW = 64 << 20
"""A filesystem with less free space than this, right after a write failed there, is the reason it failed."""


def _size(n: int) -> str:
    """Bytes for a person: '0 B', '4.0 KiB', '1.5 GiB'."""
    if n < 1024:
        return f"{n} B"
    exponent = min(4, (n.bit_length() - 1) // 10)
    return f"{n / (1 << (10 * exponent)):.1f} {('KiB', 'MiB', 'GiB', 'TiB')[exponent - 1]}"


def disk_space(where: Path) -> tuple[int, int] | None:
    """(free, total) bytes of the filesystem holding `where` (its nearest existing parent), None if
    unknown."""
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.free, usage.total


def no_space_line(where: Path | None) -> str:
    """The system's 'No space left on device', with the free space of the filesystem holding `where`."""
    space = disk_space(where) if where is not None else None
    told = f" ({_size(space[0])} free of {_size(space[1])} on the disk holding {where})" if space else ""
    return f"{os.strerror(errno.ENOSPC)}{told}"


def write_failure(err: BaseException, where: Path | None = None) -> str:
    """Why a write into `where` failed, on one line. torch's zip writer (torch.save, and DCP's shards) loses
    the system's reason: a full disk or a file size limit (`ulimit -f`; Python ignores SIGXFSZ, so the
    write fails with EFBIG) both read "enforce fail at inline_container.cc ... unexpected pos". Say which:
    the limit when one is set, no space when the filesystem holding `where` is (nearly) full."""
    root = _root(err)
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    cut_short = "inline_container.cc" in str(root)  # torch's writer: the OS's errno is gone
    too_large = getattr(root, "errno", None) == errno.EFBIG or cut_short
    if too_large and soft != resource.RLIM_INFINITY:
        return (f"a file reached the file size limit ({soft} bytes: ulimit -f {soft // 1024}; raise it, e.g. "
                "ulimit -f unlimited)")
    if getattr(root, "errno", None) == errno.ENOSPC:
        return no_space_line(where or getattr(root, "filename", None))
    if cut_short:
        space = disk_space(where) if where is not None else None
        if space is not None and space[0] < FULL_BELOW:
            return no_space_line(where)
        return "a write was cut short (torch's file writer stopped: a full disk or quota, or an I/O error)"
    return one_line(err)


def load_failure(err: BaseException) -> str:
    """Why a file read with torch.load(weights_only=True) does not load, on one line: 'cannot load it, <the
    error>', or for a pickled object what that means. torch refuses one (good) but suggests
    weights_only=False, which would run it: say instead that flashdapo never writes such a file."""
    name = refused_pickle(err)
    if name is not None:
        named = f", {name}," if name else ""
        return (
            f"not a file flashdapo wrote, or a corrupted one: it holds a pickled Python object{named} where "
            "flashdapo writes only tensors and plain data; not loaded, since unpickling it could run code")
    return f"cannot load it, {one_line(err)}"


# ---------------------------------------------------------------------------------------------------
# RNG states as plain data (tensors, numbers, lists): loadable with weights_only=True


def _rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------------
# Saving


def save_checkpoint(run_dir: Path, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainerState, keep_last: int, rank_state: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of `state.step` atomically (tmp dir + rename) and prune this run's old ones.
    `rank_state`: this rank's own plain state (the streaming sampler's carried work), one file per rank.

    Raises CheckpointError on every rank, having written nothing, when the weights hold NaN/inf or a write
    fails (e.g. a full disk); older checkpoints are left intact either way."""
    root = checkpoint_root(run_dir)
    final = root / f"step_{state.step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if not all_finite(model):
        newest = latest_checkpoint(run_dir)
        raise CheckpointError(
            f"step {state.step}: the weights hold NaN or inf, so no checkpoint was written; "
            f"the newest good checkpoint is {newest or 'none'}")

    def prepare() -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)

    def write() -> None:
        model_sd, optim_sd = model_and_optimizer_state(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(_rng_state(), tmp / f"rng_rank{env.rank}.pt")
        if rank_state is not None:
            torch.save(rank_state, tmp / f"{RANK_STATE}{env.rank}.pt")
        if env.is_main:
            torch.save(dataclasses.asdict(state), tmp / "trainer_state.pt")

    def publish() -> None:
        unseen = unseen_shards(tmp, env.world_size)
        if unseen:
            raise CheckpointError(
                f"rank 0 does not see every rank's files in {tmp} (missing: {', '.join(unseen[:4])}"
                f"{', ...' if len(unseen) > 4 else ''}): each rank wrote its shard into a directory "
                "of the same name on its own disk; the run directory must be one storage every "
                "rank sees (a filesystem all nodes share, an absolute logging.run_dir)")
        marker = {
            "step": state.step, "world_size": env.world_size, "run_id": state.run_id, "time": time.time()
        }
        _write_synced(tmp / MARKER, json.dumps(marker))
        if final.exists():  # this run's own checkpoint of the same step (resumed from an older one)
            shutil.rmtree(final)
        os.replace(tmp, final)

    _on_every_rank(env, prepare if env.is_main else None, final, tmp)
    _on_every_rank(env, write, final, tmp)
    _on_every_rank(env, publish if env.is_main else None, final, tmp)
    if env.is_main:
        _prune(root, keep_last, state.run_id)
    return final


def model_and_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """DCP's (model, optimizer) state dicts, without the trace torch leaves on an optimizer that has not
    stepped.

    To have state to save, torch initialises a fresh optimizer by taking one step with zero gradients at lr 0
    (`torch.distributed.checkpoint.state_dict._init_optim_state`). The weights and AdamW's moments stay as
    they were, but its step count becomes 1: a run stopped before its first update (dynamic sampling still
    collecting, say) and resumed would take that update with step 2's bias correction, the uninterrupted run
    with step 1's. The count goes back to 0, in the live optimizer and in what is saved.

    Under LoRA only the adapters (and the norms lora.train_norms trains) are in the model's state (the frozen
    base is the model.path checkpoint's, or the toy's warm-up, rebuilt at resume), and only they have
    optimizer state."""
    fresh = not optimizer.state
    options = _options(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if options.ignore_frozen_params:  # a tied head stays in (DCP drops frozen parameters by their first name)
        trains = trained(getattr(model, "hf", model))
        model_sd = {name: value for name, value in model_sd.items() if trains(name)}
    if fresh:
        for state in [*optimizer.state.values(), *optim_sd.get("state", {}).values()]:
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                state["step"] = 0
    return model_sd, optim_sd


def _options(model: nn.Module) -> StateDictOptions:
    """DCP's options for `model`: with adapters (LoRA), the frozen base left out of saves and loads (what a
    load leaves out is what the save left out, from the same call)."""
    adapted = layout_of(getattr(model, "hf", model)) is not None
    return StateDictOptions(ignore_frozen_params=adapted, strict=not adapted)


def _on_every_rank(env: DistEnv, action: Callable[[], None] | None, final: Path, tmp: Path) -> None:
    """Run this rank's part of a save; if any rank failed, remove the temporary directory and raise one
    CheckpointError on every rank, with the first failed rank's reason (no rank is left waiting in a
    collective, and whichever rank reports it names the real cause)."""
    error: BaseException | None = None
    try:
        if action is not None:
            action()
    except (OSError, RuntimeError, ValueError, CheckpointException) as err:
        # A second Ctrl-C stops at once: the stop itself, not a failed write (inside dcp.save it comes wrapped
        # in a CheckpointException); the next save clears the temporary directory.
        stop = interruption_of(err)
        if stop is not None:
            raise stop from None
        error = err
    reasons = all_gather_objects("" if error is None else str(error)
                                 if isinstance(error, CheckpointError) else write_failure(error, tmp.parent))
    failed = [(rank, reason) for rank, reason in enumerate(reasons) if reason]
    if not failed:
        return
    barrier()
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    rank, reason = failed[0]
    where = f" (rank {rank})" if env.world_size > 1 else ""
    raise CheckpointError(
        f"cannot write checkpoint {final}{where}: {reason}. Older checkpoints are intact; free "
        f"disk space (or fix the error), then continue with --checkpoint.resume auto") from error


def unseen_shards(path: Path, world_size: int) -> list[str]:
    """The files of a checkpoint being written that rank 0 cannot see: a rank's RNG state, or a data file the
    DCP metadata (written by rank 0 from every rank's report) names, missing or shorter than recorded."""
    unseen = [f"rng_rank{r}.pt" for r in range(world_size) if not (path / f"rng_rank{r}.pt").is_file()]
    sizes: dict[str, int] = {}
    for info in dcp.FileSystemReader(str(path)).read_metadata().storage_data.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(sizes.items()):
        file = path / name
        if not file.is_file() or file.stat().st_size < size:
            unseen.append(name)
    return unseen


def all_finite(model: nn.Module) -> bool:
    """Whether every parameter shard on every rank is finite (one all-reduce)."""
    bad = torch.zeros(1)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not torch.isfinite(local.detach()).all():
            bad[0] = 1.0
            break
    return all_reduce(bad, "max").item() == 0


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_marker(path: Path) -> dict[str, Any]:
    """A checkpoint's COMPLETE marker (step, world size, run id; markers that predate run ids have none).
    CheckpointError saying what is wrong when it is missing or does not parse (a truncated or half-copied
    checkpoint): such a checkpoint is damaged, and records no run."""
    file = path / MARKER
    try:
        marker = json.loads(file.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{file}: missing") from err
    except (OSError, ValueError) as err:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{file}: does not parse ({one_line(err)})") from err
    if not isinstance(marker, dict) or not isinstance(marker.get("run_id", ""), str):
        raise CheckpointError(
            f"{file}: not a checkpoint marker (expected a JSON object with a string run_id)")
    return marker


def marker_run_id(path: Path) -> str | None:
    """The run id in a checkpoint's COMPLETE marker ('' in markers that predate run ids; None if damaged)."""
    try:
        return read_marker(path).get("run_id", "")
    except CheckpointError:
        return None


def _prune(root: Path, keep_last: int, run_id: str) -> None:
    """Remove this run's complete checkpoints beyond the newest `keep_last`; never another run's."""
    mine = [p for p in _complete(root) if marker_run_id(p) == run_id]
    for old in mine[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------
# Finding and loading


def _missing(path: Path) -> list[str]:
    """The files every checkpoint has that `path` lacks."""
    return [name for name in (MARKER, ".metadata", "trainer_state.pt") if not (path / name).is_file()]


def _step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories under root, complete or not, oldest first (temporary `.tmp` ones never
    count)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir())


def _complete(root: Path) -> list[Path]:
    """Complete checkpoint directories under root, oldest first."""
    return [p for p in _step_dirs(root) if not _missing(p)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint under run_dir."""
    found = _complete(checkpoint_root(run_dir))
    return found[-1] if found else None


def resume_candidates(resume: str, run_dir: Path, warn: Callable[[str],
                                                                 None] = lambda _m: None) -> list[Path]:
    """'' -> [] (fresh); 'auto' -> the complete checkpoints, newest first, warning about each step directory
    skipped for a missing file; a path -> [that checkpoint], validated, with an error naming what is
    missing."""
    if not resume:
        return []
    if resume == "auto":
        found = _step_dirs(checkpoint_root(run_dir))[::-1]
        for path in found:
            if missing := _missing(path):
                warn(
                    f"warning: skipping checkpoint {path.name}, it is damaged (missing {', '.join(missing)})")
        return [p for p in found if not _missing(p)]
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.resume={resume}: no such directory")
    missing = _missing(path)
    if missing:
        raise CheckpointError(f"checkpoint.resume={resume}: not a complete flashdapo checkpoint "
                              f"(missing {', '.join(missing)}); an interrupted save leaves such a directory")
    return [path]


def load_first_loadable(candidates: list[Path], env: DistEnv, model: nn.Module,
                        optimizer: torch.optim.Optimizer, warn: Callable[[str], None],
                        check: StateCheck | None = None) -> tuple[Path, TrainerState] | None:
    """Load the first candidate that loads, warning about each one skipped; None when there are none.
    Raises CheckpointError when candidates exist but none loads; `check`'s errors propagate (never
    skipped)."""
    errors = []
    for path in candidates:
        try:
            return path, load_checkpoint(path, env, model, optimizer, check)
        except CheckpointError as err:
            errors.append(err)
            if path is not candidates[-1]:
                warn(
                    f"warning: skipping checkpoint {path.name}, it does not load ({err}); trying an older one"
                )
    if errors:
        raise CheckpointError(f"no checkpoint loads ({len(errors)} tried; the last: {errors[-1]}). Move the "
                              "damaged ones aside or start a fresh run in another logging.run_dir")
    return None


def _safe_load(path: Path) -> Any:
    """torch.load restricted to tensors and plain containers (a pickled object is refused, not run)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling refusals, truncated zips and I/O errors all mean "cannot load"
        raise CheckpointError(f"{path}: {load_failure(err)}") from err


RANK_STATE = "stream_rank"
"""Per-rank state files: <RANK_STATE><rank>.pt."""


def load_rank_state(path: Path, env: DistEnv) -> dict[str, Any] | None:
    """This rank's plain state saved with the checkpoint at `path`; None when it holds none or was written
    at another world size (each rank's state belongs to the rank that wrote it)."""
    marker = read_marker(path)
    mine = path / f"{RANK_STATE}{env.rank}.pt"
    if marker.get("world_size") != env.world_size or not mine.is_file():
        return None
    return _safe_load(mine)


def load_checkpoint(path: Path, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer,
                    check: StateCheck | None = None) -> TrainerState:
    """Load weights, optimizer, RNG (this rank's, else rank 0's at another world size) and the state;
    `check(state, path)` runs before the weights load (every rank computes the same verdict).

    Every rank raises CheckpointError together when any part fails to load on any rank."""
    rng_file = path / f"rng_rank{env.rank}.pt"
    if not rng_file.is_file():
        rng_file = path / "rng_rank0.pt"
    error: CheckpointError | None = None
    try:
        read_marker(path)  # a damaged marker records no run: resume.py could not tell whose checkpoint it is
        state = TrainerState.from_plain(_safe_load(path / "trainer_state.pt"), path / "trainer_state.pt")
        rng = _safe_load(rng_file)
        load_rank_state(path, env)  # read again once resumed; a bad one skips this checkpoint, as above
    except CheckpointError as err:
        error = err
    if all_reduce(torch.tensor([float(error is not None)]), "max").item() > 0:
        raise error or CheckpointError(f"checkpoint {path}: another rank could not load its part")
    if check is not None:
        check(state, path)
    model_sd, optim_sd = model_and_optimizer_state(model, optimizer)
    state_dict = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state_dict, checkpoint_id=str(path))
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path}: cannot load model/optimizer ({one_line(err)})") from err
    set_state_dict(model, optimizer, model_state_dict=state_dict["model"],
                   optim_state_dict=state_dict["optim"], options=_options(model))
    _set_rng_state(rng)
    return state

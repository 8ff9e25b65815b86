"""The start every rank agrees on before any model loads: one run directory, one checkpoint to resume.

On several nodes each node's launcher starts its workers in its own working directory, and torchrun's c10d
rendezvous gives rank 0 to whichever node it likes: a relative `logging.run_dir`, or one on a node's local
disk, is then a different directory on each node. Each rank would write its checkpoint shards where rank 0
never looks, and a resume could find a checkpoint on one node and none on another. So, in this order:

- **The lock.** Rank 0 claims the run directory (rundir.py: ownership and liveness); every rank stops on
  its verdict.
- **One storage.** Rank 0 writes a token file (random content) into the run directory; every rank reads it
  back. A rank that does not find it stops every rank with one line naming its host and rank and the path it
  looked at, and what to do (a run directory on a filesystem every node shares, as an absolute path).
- **One checkpoint.** Rank 0 alone reads `run.json` and `checkpoints/` and decides what to resume
  (resume.py: only this run's checkpoints, newest first); the decision is broadcast, so no rank can take
  another branch than rank 0. Every rank then checks that it sees the chosen checkpoints' files; one that
  does not stops every rank in one line.
- **Short waits.** These collectives run under `trainer.setup_timeout_s` (the process group starts with
  it), so ranks that disagree at start fail in seconds; `setup_run` then sets `trainer.collective_timeout_s`
  for the model load and everything after. Nothing here assumes that node 0 holds rank 0.

A checkpoint is also marked complete only when rank 0 sees every rank's shard files (checkpoint.py).
"""

from __future__ import annotations

import datetime
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from ...config import Config
from ...distributed.collectives import all_gather_objects, broadcast_object
from ...distributed.mesh import DistEnv
from ...errors import FlashdapoError
from .checkpoint import MARKER, CheckpointError, resume_candidates
from .resume import own_checkpoints
from .rundir import RunDirClaim, RunDirError, claim_run_dir, recorded_run_id, stop_if_launcher_dies

TOKEN_PREFIX = ".flashdapo-storage-check-"
SHARED_STORAGE_ADVICE = (
    "every rank must see one run directory (each rank writes its checkpoint shards there "
    "and rank 0 reads them): put logging.run_dir on a filesystem every node shares and give it "
    "as an absolute path (a relative one resolves in each launcher's working directory)")


@dataclass
class StartPlan:
    """What every rank agreed on at start."""

    claim: RunDirClaim | None
    """Rank 0's lock on the run directory (None on the other ranks)."""
    dir_run_id: str | None = None
    """The run id the directory's run.json records (None for a fresh run or a directory without one)."""
    candidates: list[Path] = field(default_factory=list)
    """The checkpoints this run may resume from, newest first, as rank 0 chose them ([] for a fresh start)."""


def agree_on_start(cfg: Config, env: DistEnv, run_dir: Path, log) -> StartPlan:
    """Claim the run directory, check that every rank sees it, choose what to resume (module docstring).
    Raises on every rank together; rank 0's lock is released when it raises after the claim."""
    claim = None
    try:
        claim = claim_on_rank0(cfg, env, run_dir, log)
        check_shared_storage(run_dir, env)
        dir_run_id, candidates = choose_resume(cfg, env, run_dir, log)
        check_visible(candidates, env)
    except BaseException as err:
        if claim is not None:
            claim.release()
        if isinstance(err, RuntimeError) and _timed_out(err):
            raise StartTimeout(
                f"rank {env.rank}: the start-up checks waited trainer.setup_timeout_s="
                f"{cfg.trainer.setup_timeout_s} s for the other ranks, in vain: a rank is stuck "
                "before them (a slow mount, a hung data or model path) or was started apart from "
                "this job; see the other ranks' output, or raise trainer.setup_timeout_s where every "
                "start is this slow") from err
        raise
    return StartPlan(claim=claim, dir_run_id=dir_run_id, candidates=candidates)


class StartTimeout(FlashdapoError, RuntimeError):
    """A start-up collective waited setup_timeout_s for the other ranks; raised by the ranks that waited."""

    every_rank = False


def _timed_out(err: BaseException) -> bool:
    """Whether a collective failed for its timeout (gloo: 'Timed out waiting ...'; NCCL: '... timeout')."""
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def claim_on_rank0(cfg: Config, env: DistEnv, run_dir: Path, log) -> RunDirClaim | None:
    """Rank 0 locks the run directory and checks it may start here; every rank raises if it may not."""
    stop_if_launcher_dies(env.rank)
    claim, error = None, ""
    if env.is_main:
        try:
            claim = claim_run_dir(run_dir, cfg.checkpoint.resume, cfg.logging.move_old_run)
        except RunDirError as err:
            error = str(err)
    error = all_gather_objects(error)[0]
    if error:
        raise RunDirError(error)
    if claim is not None and claim.moved_to is not None:
        log(f"moved the previous run's files from {run_dir} to {claim.moved_to} (logging.move_old_run)")
    return claim


def _where() -> str:
    return socket.gethostname()


def _read_back(path: Path, token: str) -> str:
    """'' when `path` holds `token`, else what this rank found instead."""
    try:
        found = path.read_text()
    except FileNotFoundError:
        return "no such file" if path.parent.is_dir() else "no such directory"
    except PermissionError:
        return "permission denied"
    except OSError as err:
        return err.strerror or type(err).__name__
    return "" if found == token else "another file of that name"


def check_shared_storage(run_dir: Path, env: DistEnv) -> None:
    """Rank 0 writes a token file into `run_dir`; every rank reads it back; RunDirError on every rank, naming
    the first rank (host, rank, the path it resolved) that does not see it."""
    if env.world_size == 1:
        return
    token, name = secrets.token_hex(16), ""
    if env.is_main:
        name = f"{TOKEN_PREFIX}{token}"
        (run_dir / name).write_text(token)  # the directory was just checked writable (claim_run_dir)
    token, name = broadcast_object((token, name))
    path = run_dir / name
    try:
        seen = all_gather_objects((_where(), str(path.parent.absolute()), _read_back(path, token)))
    finally:
        if env.is_main:
            path.unlink(missing_ok=True)
    blind = [(rank, host, where, why) for rank, (host, where, why) in enumerate(seen) if why]
    if blind:
        rank, host, where, why = blind[0]
        more = f" (and {len(blind) - 1} more rank(s))" if len(blind) > 1 else ""
        raise RunDirError(
            f"logging.run_dir={run_dir}: rank {rank} on host {host} does not see the run directory "
            f"rank 0 writes on host {seen[0][0]} ({where}: {why}){more}; {SHARED_STORAGE_ADVICE}")


def choose_resume(cfg: Config, env: DistEnv, run_dir: Path, log) -> tuple[str | None, list[Path]]:
    """Rank 0 reads run.json and checkpoints/ and chooses the resume candidates (resume.py); every rank gets
    its choice, or raises the error it raised."""
    decided: tuple[str | None, list[str]] | FlashdapoError | None = None
    if env.is_main:
        try:
            # a fresh run is a new run
            dir_run_id = recorded_run_id(run_dir) if cfg.checkpoint.resume else None
            found = resume_candidates(cfg.checkpoint.resume, run_dir, log)
            chosen = own_checkpoints(found, dir_run_id, cfg.checkpoint.resume != "auto")
            decided = (dir_run_id, [str(p) for p in chosen])
        except FlashdapoError as err:  # one line on every rank; a bug's traceback stays rank 0's (failfast)
            decided = err
    decided = broadcast_object(decided)
    if isinstance(decided, FlashdapoError):
        raise decided
    dir_run_id, chosen = decided
    return dir_run_id, [Path(p) for p in chosen]


def check_visible(candidates: list[Path], env: DistEnv) -> None:
    """Every rank sees each checkpoint rank 0 chose (its marker and DCP metadata); CheckpointError on every
    rank naming the first rank that does not."""
    if env.world_size == 1 or not candidates:
        return
    missing = [f"{path}/{name}" for path in candidates for name in (MARKER, ".metadata")
               if not (path / name).is_file()]
    seen = all_gather_objects((_where(), missing))
    blind = [(rank, host, gone) for rank, (host, gone) in enumerate(seen) if gone]
    if blind:
        rank, host, gone = blind[0]
        raise CheckpointError(
            f"rank {rank} on host {host} cannot see the checkpoint rank 0 resumes from (no "
            f"{gone[0]} there{f', and {len(gone) - 1} more file(s)' if len(gone) > 1 else ''}); "
            f"{SHARED_STORAGE_ADVICE}")


def set_collective_timeout(seconds: float) -> None:
    """The timeout of every later collective of the default process group (the start used setup_timeout_s)."""
    if dist.is_initialized():
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=seconds))


__all__ = [
    "StartPlan", "StartTimeout", "agree_on_start", "check_shared_storage", "check_visible", "choose_resume",
    "set_collective_timeout", "TOKEN_PREFIX"
]

"""A run owns its directory, and a live run holds it.

- **Ownership.** A fresh run (`checkpoint.resume` empty) refuses a directory that already holds a run's
  checkpoints, metrics or export, rather than overwrite its metrics, prune its checkpoints and later
  resume the wrong one. The user says what to do: `--checkpoint.resume auto` continues that run;
  `--logging.move-old-run true` moves its files to a sibling `<run_dir>.old-<UTC time>/` (nothing is ever
  deleted) and starts fresh; or another `--logging.run-dir`. Each run has an id, recorded in its
  checkpoints; pruning only removes checkpoints carrying this run's id.
- **Liveness.** A live run holds an exclusive `flock` on `<run_dir>/.flashdapo.lock` (rank 0); a second
  run or a resume in that directory is refused while it is held. The kernel releases the lock when the
  process dies, however it dies, so a crashed run never leaves a stale lock behind.
- **One run, its history kept.** `<run_dir>/run.json` records the run's id and each start (UTC time, step, the
  config file written, the checkpoint resumed and the settings changes accepted). `config.yaml` is the first
  start's config and is never rewritten; the N-th resume writes `config.resume-<N>.yaml`. A resume only
  continues checkpoints carrying the id in run.json (resume.py), so metrics.jsonl never mixes two runs.
- **Writable up front.** The run directory and its `checkpoints/` and `export/` (where they exist) are
  checked writable when the run starts (a file is created and removed in each), not at the first save.
- **No orphans.** Under torchrun, each worker watches its parent (the torchrun launcher): if the launcher dies
  (SIGKILL leaves its workers running, in process groups of their own), the worker stops within about a second
  instead of training on alone and racing the next run in the same directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ...distributed.failfast import exit_with_line
from ...errors import FlashdapoError

LOCK_NAME = ".flashdapo.lock"
RECORD_NAME = "run.json"
_RESUME_CONFIG = re.compile(r"^config\.resume-(\d+)\.yaml$")


class RunDirError(FlashdapoError, RuntimeError):
    """The run directory cannot be used as asked; the message says why and what to do."""


@dataclass
class RunDirClaim:
    """This process's hold on its run directory (rank 0): the open, flock-ed lock file."""

    path: Path
    lock: IO[str]
    moved_to: Path | None
    """Where a previous run's files were moved (logging.move_old_run), else None."""

    def release(self) -> None:
        self.lock.close()


def new_run_id() -> str:
    """A fresh run's id: UTC start time plus random hex (unique across runs in one directory)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


def previous_run(path: Path) -> str:
    """A description of the run data found in `path` ('' when there is none)."""
    found = []
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        found.append(f"{sum(1 for _ in checkpoints.iterdir())} checkpoint entries")
    metrics = path / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    found += [f"{name}/" for name in ("export", "rollouts", "split_rollout") if (path / name).exists()]
    return ", ".join(found)


def claim_run_dir(path: Path, resume: str, move_old_run: bool) -> RunDirClaim:
    """Create and lock `path` for this run (rank 0 only); refuse another run's data unless told.

    resume '' is a fresh run: it refuses a directory holding a run's data, unless move_old_run moves that
    data aside. resume 'auto' or a path continues a run, so existing data is expected."""
    if path.exists() and not path.is_dir():
        raise RunDirError(f"logging.run_dir={path} is a file, not a directory; choose a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = (path / LOCK_NAME).open("a+")
    except OSError as err:
        raise RunDirError(
            f"logging.run_dir={path}: cannot create it or its lock file ({err.strerror})") from err
    _lock(lock, path)
    moved_to = None
    found = previous_run(path)
    if found and not resume:
        if not move_old_run:
            lock.close()
            raise RunDirError(
                f"logging.run_dir={path} holds a previous run ({found}); continue it with "
                "--checkpoint.resume auto, "
                f"start over with --logging.move-old-run true (moves its files to {path.name}.old-<time>/, "
                "deletes "
                "nothing), or choose another --logging.run-dir")
        moved_to = _move_aside(path)
    try:
        check_writable(path)
    except RunDirError:
        lock.close()
        raise
    return RunDirClaim(path=path, lock=lock, moved_to=moved_to)


def check_writable(path: Path) -> None:
    """Create and remove a file in the run directory and in its checkpoints/ and export/ where they exist
    (else the run creates them in the run directory); RunDirError naming the first that refuses, so a
    read-only directory stops the run before any work."""
    for directory in (path, path / "checkpoints", path / "export"):
        if directory != path and not directory.exists():
            continue
        try:
            with tempfile.TemporaryFile(dir=directory, prefix=".flashdapo-write-check-"):
                pass
        except OSError as err:
            raise RunDirError(
                f"{directory} is not writable ({err.strerror}); a run writes its checkpoints, "
                "metrics and export there: fix the permissions or choose another --logging.run-dir") from err


def recorded_run_id(path: Path) -> str | None:
    """The run id recorded in `<path>/run.json`, None without one (a new directory, or an older
    flashdapo's)."""
    record = _read_record(path)
    return record["run_id"] if record else None


def _read_record(path: Path) -> dict[str, Any] | None:
    file = path / RECORD_NAME
    try:
        record = json.loads(file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise RunDirError(f"{file}: cannot read it ({err}); it records which run this directory holds: "
                          "restore it, or start a fresh run in another --logging.run-dir") from err
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str) or not isinstance(
            record.get("starts", []), list):
        raise RunDirError(
            f"{file}: not a flashdapo run record (expected run_id and starts); restore it, or start "
            "a fresh run in another --logging.run-dir")
    return record


def record_start(path: Path, run_id: str, step: int, config_yaml: str, resumed_from: Path | None,
                 changes: list[tuple[str, Any, Any]], fresh: bool) -> str:
    """Rank 0, once a run has started: write its config (config.yaml on the first start, never rewritten;
    config.resume-<N>.yaml on the N-th resume) and append the start to run.json. Returns the config's name.
    A fresh run (checkpoint.resume empty; claim_run_dir found no run data here) starts a new record, and so
    does the first start of `checkpoint.resume auto` in a directory without a run record that found no
    checkpoint to resume (`flashdapo ablate` starts every run so); a config.yaml already there is then kept:
    the config this start was given, written beforehand (the ablation writes each run's, `auto` fields and
    all, so that it reruns the run alone)."""
    first = fresh or (resumed_from is None and _read_record(path) is None)
    name = "config.yaml"
    if not first and (path / name).exists():
        taken = [int(m.group(1)) for p in path.iterdir() if (m := _RESUME_CONFIG.match(p.name))]
        name = f"config.resume-{max(taken, default=0) + 1}.yaml"
    if fresh or not (path / name).exists():
        (path / name).write_text(config_yaml)
    record = (None if first else _read_record(path)) or {"run_id": run_id, "starts": []}
    start: dict[str, Any] = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "step": step,
                             "config": name}
    if resumed_from is not None:
        start["resumed_from"] = str(resumed_from)
        start["accepted_changes"] = {field: [old, new] for field, old, new in changes}
    record["starts"].append(start)
    tmp = path / (RECORD_NAME + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path / RECORD_NAME)
    return name


def _lock(lock: IO[str], path: Path) -> None:
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise RunDirError(
            f"logging.run_dir={path} is in use by a live run ({holder}); wait for it to end or stop "
            "it, or choose another --logging.run-dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    lock.flush()


def _move_aside(path: Path) -> Path:
    """Move every entry of `path` but the lock into a new sibling `<name>.old-<UTC time>`."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, n = path.with_name(f"{path.name}.old-{stamp}"), 1
    while target.exists():  # two moves within one second
        n += 1
        target = path.with_name(f"{path.name}.old-{stamp}-{n}")
    target.mkdir()
    for entry in path.iterdir():
        if entry.name != LOCK_NAME:
            shutil.move(str(entry), str(target / entry.name))
    return target


def stop_if_launcher_dies(rank: int, poll_s: float = 0.5) -> None:
    """Under torchrun, end this worker soon after the torchrun launcher (its parent) dies.

    torchrun starts workers in process groups of their own, so a SIGKILL of the launcher alone leaves them
    running (and holding the run directory). A daemon thread compares os.getppid() with the launcher's pid:
    once the worker is re-parented it exits. Checkpoints are written to a temporary directory and renamed, so
    an exit at any moment leaves the run resumable."""
    watcher = "flashdapo-launcher-watch"
    if "TORCHELASTIC_RUN_ID" not in os.environ or any(t.name == watcher for t in threading.enumerate()):
        return
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        exit_with_line(
            f"flashdapo: error: rank {rank}: the torchrun launcher (pid {launcher}) died; this worker stops "
            "instead of training on alone. Resume with --checkpoint.resume auto")

    threading.Thread(target=watch, name=watcher, daemon=True).start()

"""Errors a user can cause and fix, and how the command line reports them.

Every such error (data, model directory, checkpoint, run directory, verifier output, non-finite training,
dynamic sampling) derives from `FlashdapoError`; its message alone says what went wrong, where, and what to
do. The CLI prints it as one line, `flashdapo: error: <message>`, and exits with status 1 (config errors,
`ConfigError`, with 2); `--debug` or `FLASHDAPO_DEBUG=1` shows the traceback instead. A full or read-only
disk, or a file the user may not access (OSError with a file name), is reported the same way, a denied
permission named as such, and so is a warning raised as an error (`python -W error`, or flashdapo's own
under logging.warnings_as_errors: flashdapo/tools/warning_lines.py). Anything else is a bug: its traceback is
shown.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
from pathlib import Path

DEBUG_ENV = "FLASHDAPO_DEBUG"

_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.ENOTDIR,
                errno.EISDIR, errno.ENOENT}


class ConfigError(Exception):
    """A config value is invalid; the message names the field (and the file it came from).

    Not a ValueError: tyro wraps ValueErrors raised while it builds the tree into a framed message;
    this one reaches the CLI, which prints it as one line."""


class FlashdapoError(Exception):
    """An error the user can fix; the message is the whole report (no traceback needed)."""

    every_rank = True
    """Raised by every rank together (same data, same collective outcome): under torchrun rank 0 alone
    reports it. False for errors one rank may hit alone; that rank reports it."""
    label = "error"
    """The word after `flashdapo:` in the line (empty: none, for a stop the user asked for)."""
    exit_status = 1


def debug_requested() -> bool:
    """Whether FLASHDAPO_DEBUG asks for tracebacks (the CLI's --debug sets it for every rank it starts)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def user_error_line(err: BaseException) -> str | None:
    """`flashdapo: error: ...` on one line for an error the user can fix, else None (a bug: show the
    traceback). Disk errors name the file and the system's reason."""
    if isinstance(err, ConfigError):  # a setting found wrong after the launch (an engine's own condition)
        return "flashdapo: config error: " + " ".join(str(err).split())
    if isinstance(err, FlashdapoError):
        message = str(err)
        if not err.label:
            return "flashdapo: " + " ".join(message.split())
    elif isinstance(err, Warning):  # python -W error: the warning's own line, as an error
        message = f"warning treated as an error: {err}"
    elif isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM) and err.filename:
        message = (f"{err.filename}: permission denied ({err.strerror}): the user running flashdapo may not "
                   "access it; fix its permissions or ownership, or choose another path")
    elif isinstance(err, OSError) and err.errno in _DISK_ERRORS and err.filename:
        message = (f"{err.filename}: {err.strerror}; free disk space or fix the permissions, then resume "
                   "with --checkpoint.resume auto")
    else:
        return None
    return "flashdapo: error: " + " ".join(message.split())


def file_in_the_way(path: os.PathLike | str) -> str:
    """The file standing where a parent directory of `path` should be (mkdir's FileExistsError or
    NotADirectoryError name the path asked for, not it); `path`'s parent when there is none."""
    target = Path(path)
    for parent in reversed(target.parents):
        if parent.exists() and not parent.is_dir():
            return str(parent)
    return str(target.parent)


def refused_pickle(err: BaseException) -> str | None:
    """For torch.load(weights_only=True) refusing a pickled object: the object's name, as torch gives it (''
    if none); None for any other error. torch's message then suggests weights_only=False, which would run it:
    never a hint to pass on (flashdapo's files, and model weights, hold only tensors and plain data)."""
    text = str(err)
    if not isinstance(err, pickle.UnpicklingError) or "weights_only" not in text:
        return None
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"[Uu]nsupported global: (\S+)", text)
    return found.group(1) if found else ""

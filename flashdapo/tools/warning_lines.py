"""Warnings in one line: how the command line shows the warnings flashdapo raises.

flashdapo raises its warnings with `warnings.warn`, so Python's filters, `python -W error` and
`pytest.warns` treat them as any warning. The command line (`__main__.main`) shows them through
`WarningLines`, its `warnings.showwarning` hook, in the style of its errors:

- A warning raised by flashdapo's own code prints as one line on stderr, `flashdapo: warning: <message>`,
  without the source path and code line Python adds (other packages' warnings keep Python's format).
- The same warning from the same place again, its numbers aside (`step 3: dynamic sampling found 0 ...`,
  then `step 4: ...`), is counted instead of printed: it would repeat every step. When the command ends,
  one line per such warning says how many more times it came.
- Once a run knows its directory (`attach_run`), every line also goes to RUN_DIR/warnings.log (each rank
  appends its own; under several ranks a line names its rank).
- `logging.warnings_as_errors` (`attach_run`) makes the next flashdapo warning an error, and
  `python -W error` every warning; either way the command line prints it as one error line,
  `flashdapo: error: warning treated as an error: <message>`, and exits with status 1.
"""

from __future__ import annotations

import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..errors import FlashdapoError

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # flashdapo/
_WARNINGS_FILES = {Path(warnings.__file__).name, "_py_warnings.py"}  # the latter: Python >= 3.14
_NUMBER = re.compile(r"\d+(\.\d+)?")
_active: WarningLines | None = None


class WarningAsError(FlashdapoError):
    """A flashdapo warning under logging.warnings_as_errors."""

    every_rank = False  # the rank that warned reports it


def _ours(filename: str) -> bool:
    try:
        return Path(filename).resolve().is_relative_to(PACKAGE_DIR)
    except (OSError, ValueError):
        return False


def _raiser() -> tuple[str, int] | None:
    """(file, line) of the code that called warnings.warn: the first frame above this hook outside the
    warnings module (Python's `stacklevel` may point further up, at the raiser's caller)."""
    frame = sys._getframe(2)
    while frame is not None and Path(frame.f_code.co_filename).name in _WARNINGS_FILES:
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


@dataclass
class WarningLines:
    """The command line's `warnings.showwarning` (see the module docstring)."""

    stream: TextIO | None = None
    """Where lines print (None: sys.stderr at the time of each warning)."""
    log: Path | None = None
    rank_tag: str = ""
    as_errors: bool = False
    counts: dict[tuple, int] = field(default_factory=dict)
    """Per kind of warning (category, place, message without its numbers): how many times it came."""
    first: dict[tuple, str] = field(default_factory=dict)
    """The message of each kind's first time (the one printed)."""

    def show(self, message, category, filename, lineno, file=None, line=None) -> None:
        raiser = _raiser()
        if not (_ours(filename) or (raiser is not None and _ours(raiser[0]))):
            warnings._showwarning_orig(message, category, filename, lineno, file, line)
            return
        text = " ".join(str(message).split())
        if self.as_errors:
            raise WarningAsError(f"warning treated as an error (logging.warnings_as_errors): {text}")
        key = (category, raiser or (filename, lineno), _NUMBER.sub("#", text))
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.counts[key] == 1:
            self.first[key] = text
            self.emit(f"flashdapo: warning: {text}")

    def emit(self, line: str) -> None:
        """Print `line` and append it to the run's warnings.log (a failed write never stops the run)."""
        print(line, file=self.stream or sys.stderr, flush=True)
        if self.log is not None:
            try:
                with self.log.open("a", encoding="utf-8") as f:
                    f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {self.rank_tag}{line}\n")
            except OSError:
                self.log = None

    def report_repeats(self) -> None:
        """One line per warning that came again after it was printed: how many more times."""
        for key, count in self.counts.items():
            if count > 1:
                first = self.first[key]
                first = first if len(first) <= 160 else first[:157] + "..."
                self.emit(
                    f"flashdapo: warning: came {count - 1} more times (numbers aside), not printed again: "
                    f"{first}"
                )
        self.counts.clear()


class showing_warnings:  # noqa: N801 - a context manager read as a phrase: `with showing_warnings():`
    """Install a WarningLines as `warnings.showwarning` for the block, then report the repeats and restore
    Python's. flashdapo's warnings are shown every time they come (filter `always`, after any `-W` given),
    so that the hook can count them."""

    def __init__(self, stream: TextIO | None = None):
        self.lines = WarningLines(stream)

    def __enter__(self) -> WarningLines:
        global _active
        self._saved = warnings.catch_warnings()
        self._saved.__enter__()
        warnings.filterwarnings("always", module=r"flashdapo(\.|$)", append=True)
        warnings.showwarning = self.lines.show
        self._previous, _active = _active, self.lines
        return self.lines

    def __exit__(self, *exc: object) -> None:
        global _active
        try:
            self.lines.report_repeats()
        finally:
            _active = self._previous
            self._saved.__exit__(None, None, None)


def attach_run(log: Path | None, rank: int, world_size: int, as_errors: bool) -> None:
    """Tell the command line's hook, when there is one, where this run's warnings.log is and whether warnings
    are errors (logging.warnings_as_errors). Without the hook (flashdapo used as a library) as_errors turns
    flashdapo's warnings into exceptions through a warnings filter."""
    if _active is None:
        if as_errors:
            warnings.filterwarnings("error", module=r"flashdapo(\.|$)")
        return
    _active.log, _active.as_errors = log, as_errors
    _active.rank_tag = f"[rank {rank}] " if world_size > 1 else ""

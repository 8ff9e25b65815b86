"""The results of an evaluation on disk: OUT/samples.jsonl (one prompt per line) and OUT/metrics.json.

The choices, stated first:
- Every finished prompt is appended as one JSON line (`PromptResult`: prompt id, 'file:row', data
  source, ground truth, and per sample the response, extracted answer, score, length, finish reason),
  then the file is flushed and fsync'ed, so a killed evaluation loses at most the prompts in flight. A write
  that fails (a full disk) cuts the file back to where it ended before, so it never ends in a torn line, and
  stops the evaluation with one line naming the file; a rerun resumes.
- OUT/eval_settings.json records what determines the samples (model, an adapter's base, data files, k,
  sampling, seed, verifier, engine). A rerun into the same OUT must match it (else a one-line error naming
  the first differing setting) and skips the prompts already in samples.jsonl; the metrics are computed
  from the file, so a resumed evaluation reports what an uninterrupted one does.
- One evaluation at a time per OUT: the evaluation holds an exclusive `flock` on OUT/.flashdapo-eval.lock
  (released by the kernel when the process ends, however it ends); a second one into the same OUT is
  refused instead of sampling the same prompts twice.
- A last line without its newline is a write cut short: it is dropped (with a warning) and the file is
  truncated before it. Any other unreadable line, a duplicated prompt, or a prompt whose 'file:row'
  differs from the data's is an error naming the line.
"""

from __future__ import annotations

import fcntl
import json
import os
import warnings
from pathlib import Path
from typing import Any

from ..data import Prompt
from ..errors import FlashdapoError
from .results import EvalReport, PromptResult


class EvalStoreError(FlashdapoError, ValueError):
    """OUT cannot hold this evaluation's results (another evaluation's, a file, in use); the message names the
    file and line and what to do."""


SAMPLES = "samples.jsonl"
SETTINGS = "eval_settings.json"
METRICS = "metrics.json"
LOCK = ".flashdapo-eval.lock"


RERUN = ("free disk space (or fix the error), then rerun the same command: it resumes after the prompts "
         "already written")


def _write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` whole, or is left as it was (EvalStoreError naming it, e.g. on a full disk)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise EvalStoreError(f"{path}: cannot write it ({err.strerror or err}); {RERUN}") from err


def append_whole(path: Path, data: bytes) -> None:
    """Append `data` to `path` and fsync; if the write fails (a full disk), cut the file back to its length
    before, so it never ends in a torn line, and raise the OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # load() drops a torn last line with a warning
            raise
    finally:
        os.close(fd)


class SampleLog:
    """Append-only per-prompt results of one evaluation in `out_dir` (used on rank 0 only)."""

    def __init__(self, out_dir: str | Path, settings: dict[str, Any]) -> None:
        """Create `out_dir` or check that the evaluation already there used the same `settings`."""
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / SAMPLES
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise EvalStoreError(f"--out {self.out_dir} is a file, not a directory; choose a directory path")
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._lock = (self.out_dir / LOCK).open("a")
        except OSError as err:
            raise EvalStoreError(
                f"--out {self.out_dir}: cannot create it or its lock file ({err.strerror})") from err
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise EvalStoreError(
                f"--out {self.out_dir} is in use by another evaluation; wait for it to end or choose "
                "another --out") from None
        settings_path = self.out_dir / SETTINGS
        settings = json.loads(json.dumps(settings))  # tuples -> lists, as they read back
        self.settings = settings
        if settings_path.is_file():
            old = json.loads(settings_path.read_text(encoding="utf-8"))
            for key in sorted(set(old) | set(settings)):
                if old.get(key) != settings.get(key):
                    self.close()
                    raise EvalStoreError(
                        f"{settings_path}: {key} was {old.get(key)!r}, this evaluation has "
                        f"{settings.get(key)!r}; "
                        f"use a fresh output directory (or the same settings to resume)")
        else:
            _write_atomic(settings_path, json.dumps(settings, indent=2) + "\n")

    def close(self) -> None:
        """Release OUT for another evaluation (also released when the process ends)."""
        self._lock.close()

    def load(self, prompts: list[Prompt]) -> list[PromptResult]:
        """The results already written, checked against `prompts` (the evaluation set, by prompt id)."""
        if not self.path.is_file():
            return []
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            warnings.warn(
                f"{self.path}: dropping an incomplete last line ({len(data) - end} bytes, an interrupted "
                f"write); its prompt is evaluated again", stacklevel=2)
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        results: list[PromptResult] = []
        seen: set[int] = set()
        for number, line in enumerate(data[:end].decode("utf-8").splitlines(), start=1):
            where = f"{self.path}: line {number}"
            try:
                result = PromptResult.from_dict(json.loads(line))
            except (json.JSONDecodeError, TypeError, KeyError) as err:
                raise EvalStoreError(f"{where}: not a prompt result ({err})") from err
            if not 0 <= result.prompt_id < len(prompts) or prompts[result.prompt_id].source != result.source:
                expected = prompts[
                    result.prompt_id].source if 0 <= result.prompt_id < len(prompts) else "no prompt"
                raise EvalStoreError(
                    f"{where}: prompt {result.prompt_id} is {result.source!r} but the data has "
                    f"{expected!r}; the data changed: use a fresh output directory")
            if result.prompt_id in seen:
                raise EvalStoreError(f"{where}: prompt {result.prompt_id} appears twice")
            seen.add(result.prompt_id)
            results.append(result)
        return results

    def append(self, results: list[PromptResult]) -> None:
        """Append results, one line each, and fsync: on disk once this returns."""
        if not results:
            return
        try:
            append_whole(self.path, "".join(json.dumps(r.to_dict()) + "\n" for r in results).encode("utf-8"))
        except OSError as err:
            raise EvalStoreError(
                f"{self.path}: cannot append {len(results)} prompt result(s) ({err.strerror or err}); "
                f"the file is kept as it was before them: {RERUN}") from err

    def write_metrics(self, report: EvalReport, extra: dict[str, Any]) -> Path:
        """OUT/metrics.json: the flat metrics (`eval/...`), every source's pass@j / maj@j, and `extra`."""
        path = self.out_dir / METRICS
        payload = {**extra, "metrics": report.metrics("eval"), "report": report.to_dict()}
        _write_atomic(path, json.dumps(payload, indent=2) + "\n")
        return path

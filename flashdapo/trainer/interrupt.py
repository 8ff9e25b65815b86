"""Ctrl-C while training: stop at the end of the step with a checkpoint, in one line, on every rank.

The first Ctrl-C (SIGINT) lets the running step finish, then the loop saves that step's checkpoint (unless
it just did) and stops with one line, `stopped at step N ...; resume with --checkpoint.resume auto`.
Why at the step's end: a checkpoint there is exactly the one an uninterrupted run writes (weights,
optimizer, LR schedule, data position and RNG all after step N), so the resumed run reproduces the
uninterrupted one bit for bit. Inside a step the state is never consistent (the data position and RNG have
moved before the weights; between two of a step's optimizer steps the schedule has not): no checkpoint is
taken there. A second Ctrl-C stops at once, without a checkpoint, naming the newest one.

Under torchrun the launcher forwards SIGINT to every worker; at each step's end the ranks agree on stopping
(a max all-reduce of one flag), so every rank stops after the same step and the save is collective as usual.
Ctrl-C during setup or the final export stops at once (no step to finish).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import torch

from ..collectives import all_reduce
from ..errors import FlashdapoError
from .checkpoint import latest_checkpoint


class Interrupted(FlashdapoError, RuntimeError):
    """Ctrl-C ended the run; the message says where it stopped and how to continue. Not an error: the line is
    `flashdapo: stopped at step N ...` and the exit status 130, the shell's for SIGINT."""

    label = ""
    exit_status = 130


class StopOnInterrupt:
    """SIGINT handling around a run (main thread only; elsewhere Python delivers no signals)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.is_main = False
        """Whether this rank prints the notice of a first Ctrl-C (rank 0, once the run is set up)."""
        self.phase = "setup"
        """What runs now: 'setup', 'step N' (a Ctrl-C then waits for the step's end) or 'the export'."""
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.phase.startswith("step") and not self.requested:
            self.requested = True
            if self.is_main:
                _notice(f"flashdapo: Ctrl-C: stopping after {self.phase} (its checkpoint is saved then); Ctrl-C "
                        "again stops at once, without it\n")
            return
        newest = latest_checkpoint(self.run_dir)
        raise Interrupted(f"stopped by Ctrl-C during {self.phase}, without a checkpoint of it; the newest "
                          f"checkpoint is {newest or 'none'}; resume with --checkpoint.resume auto")

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (every rank calls this at the same point of each step)."""
        return all_reduce(torch.tensor([float(self.requested)]), "max").item() > 0

    def stopped(self, step: int) -> Interrupted:
        """The error that ends a run stopped after `step`, whose checkpoint is saved."""
        return Interrupted(f"stopped at step {step} by Ctrl-C, after saving its checkpoint "
                           f"{latest_checkpoint(self.run_dir)}; resume with --checkpoint.resume auto")


def _notice(text: str) -> None:
    """Write from a signal handler: os.write, since a print could re-enter a print the signal interrupted (a
    RuntimeError); a stream without a file descriptor (a test's capture) takes a plain write."""
    try:
        os.write(sys.stderr.fileno(), text.encode())
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        sys.stderr.write(text)

"""Ctrl-C or SIGTERM while training: stop at the end of the step with a checkpoint, in one line, on every
rank.

The first Ctrl-C (SIGINT) or SIGTERM lets the running step finish, then the loop saves that step's
checkpoint (unless it just did) and stops with one line, `stopped at step N ...; resume with
--checkpoint.resume auto`. Why at the step's end: a checkpoint there is exactly the one an uninterrupted run
writes (weights, optimizer, LR schedule, data position and RNG all after step N), so the resumed run
reproduces the uninterrupted one bit for bit. Inside a step the state is never consistent (the data
position and RNG have moved before the weights; between two of a step's optimizer steps the schedule has
not): no checkpoint is taken there. A second signal stops at once, without a checkpoint, naming the newest
one.

SIGTERM is what a scheduler sends before it ends a job (SLURM's scancel and preemption, Kubernetes) and what
torchrun sends the other ranks when one rank died. In the first case every rank finishes its step and the
checkpoint is saved; in the second no checkpoint is promised: the handler first asks fail-fast (`lost`)
whether another rank failed or died, and if one did this rank ends at once with the line naming it
(failfast.py); where that cannot be seen yet, the step's next collective fails at once on the dead peer, and
that failure is the one line reported, not a launcher's bare kill.

Under torchrun the launcher forwards SIGINT to every worker; at each step's end the ranks agree on stopping
(a max all-reduce of one flag), so every rank stops after the same step and the save is collective as usual.
A signal during setup stops at the end of setup's current stage (there is no step to finish or save; a
rank that stops there ends the others, failfast.py); one during the validation before step 1 or the final
export, once it is done. The signal handler only sets a flag, checked at those safe points: an exception
raised from a handler can land in a finalizer, which swallows it (`StopOnInterrupt`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

import torch

from ..errors import FlashdapoError
from .collectives import all_reduce


class Interrupted(FlashdapoError, RuntimeError):
    """Ctrl-C or SIGTERM ended the run; the message says where it stopped and how to continue. Not an error:
    the line is `flashdapo: stopped at step N ...` and the exit status the shell's for the signal (130 for
    SIGINT, 143 for SIGTERM)."""

    label = ""
    exit_status = 130

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_status = 128 + int(signum)


def signal_name(signum: int) -> str:
    """How a stop line names a signal: 'Ctrl-C' for SIGINT, else its name ('SIGTERM')."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


SIGNALS = (signal.SIGINT, signal.SIGTERM)

_raised: Interrupted | None = None
"""The stop a second signal raised in this process, if one did (see interruption_of)."""


class StopOnInterrupt:
    """SIGINT and SIGTERM handling around a run (main thread only; elsewhere Python delivers no signals).

    The first signal only sets a flag (and prints a notice): the run checks it at its safe points, the end of
    each step (`agreed`) and between the stages of setup, the validation before step 1 and after the export
    (`check`). A handler that raised could raise inside whatever runs at that moment, a finalizer included,
    where Python prints "Exception ignored in ..." and goes on: the stop would be lost. A second signal
    raises at once; should that exception be swallowed, the flag still stops the run at the next safe
    point."""

    def __init__(self, newest_checkpoint: Callable[[], object]):
        self.newest_checkpoint = newest_checkpoint
        """The run's newest complete checkpoint (or None), named in the stop lines."""
        self.is_main = os.environ.get("RANK", "0") == "0"
        """Whether this rank prints the notice of a first signal (rank 0)."""
        self.phase = "setup"
        """What runs now: 'setup', 'step N' (a signal then waits for the step's end) or 'the export'."""
        self.requested = False
        self.signum = signal.SIGINT
        """The first signal received (its name goes into the lines, its number into the exit status)."""
        self.lost: Callable[[], bool] = lambda: False
        """Asked first on a first signal: whether the job is ending on another rank's failure or death, this
        process with it in its own line (failfast.FailFast.end_if_lost). torchrun signals the survivors of a
        dead rank: a stop then would promise a checkpoint that needs the dead rank and is never written."""
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnInterrupt:
        global _raised
        _raised = None
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        global _raised
        _raised = None  # the run is over: a later save (another run in this process) is not stopped by it
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            self.requested, self.signum = True, signum
            if self.lost():  # no stop to keep: this process ends on the other rank's failure or death
                return
            if self.is_main:
                step = self.phase.startswith("step")
                then = f"after {self.phase} (its checkpoint is saved then)" if step else \
                    f"at the next safe point of {self.phase}"
                _notice(f"flashdapo: {signal_name(signum)}: stopping {then}; Ctrl-C again stops at once"
                        f"{', without it' if step else ''}\n")
            return
        global _raised
        _raised = self.interrupted(finished=False)
        raise _raised

    def interrupted(self, finished: bool) -> Interrupted:
        """The error of a stop outside a step's end, where no checkpoint is taken. `finished`: the phase
        completed (a safe point after it), else it was cut short (a second signal)."""
        name, newest = signal_name(self.signum), self.newest_checkpoint()
        if finished and self.phase == "the export":
            return Interrupted(
                f"stopped by {name} during the export, once it was written: the run is complete "
                f"(its newest checkpoint is {newest or 'none'})", self.signum)
        return Interrupted(
            f"stopped by {name} during {self.phase}, without a checkpoint of it; the newest "
            f"checkpoint is {newest or 'none'}; resume with --checkpoint.resume auto", self.signum)

    def check(self) -> None:
        """A safe point outside a step: raise Interrupted if a stop was asked for (on this rank)."""
        if self.requested:
            raise self.interrupted(finished=True)

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (every rank calls this at the same point of each step); every
        rank then names the same signal (the highest number asked: SIGTERM over SIGINT)."""
        asked = int(all_reduce(torch.tensor([float(self.signum if self.requested else 0)]), "max").item())
        if asked:
            self.signum = asked
        return asked > 0

    def stopped(self, step: int) -> Interrupted:
        """The error that ends a run stopped after `step`, whose checkpoint is saved."""
        return Interrupted(
            f"stopped at step {step} by {signal_name(self.signum)}, after saving its checkpoint "
            f"{self.newest_checkpoint()}; resume with --checkpoint.resume auto", self.signum)


def _notice(text: str) -> None:
    """Write from a signal handler: os.write, since a print could re-enter a print the signal interrupted (a
    RuntimeError); a stream without a file descriptor (a test's capture) takes a plain write."""
    try:
        os.write(sys.stderr.fileno(), text.encode())
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        sys.stderr.write(text)


def interruption_of(err: BaseException | None) -> Interrupted | None:
    """The Interrupted that `err` is, or was raised from or while handling, or that a rank's failure inside a
    torch.distributed.checkpoint save or load holds (DCP wraps every exception of its stages, a stop included,
    into a CheckpointException whose `failures` map ranks to (exception, traceback)): a stop that a writer
    wrapped into its own error ('cannot write checkpoint ...: Interrupted') is still the stop.

    Failing those, the stop a second signal raised in this process. A stop landing in the Python write that
    torch's zip writer calls (torch.save, DCP's shards) leaves the writer behind the file: torch.save then
    fails with "[enforce fail at inline_container.cc] unexpected pos", the stop only its __context__, and
    under a process group DCP hands a rank's failure around pickled, which drops __context__: what is left
    reads as a full disk. Whatever fails after a second signal fails because of it. None if there is none."""
    seen: set[int] = set()
    pending = [err]
    while pending:
        err = pending.pop()
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        if isinstance(err, Interrupted):
            return err
        seen.add(id(err))
        failures = getattr(err, "failures", None)  # a CheckpointException's {rank: (exception, traceback)}
        if isinstance(failures, dict):
            pending += [failure[0] for failure in failures.values() if isinstance(failure, tuple)]
        pending += [err.__cause__, err.__context__]
    return _raised

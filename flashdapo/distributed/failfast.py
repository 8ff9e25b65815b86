"""One rank's failure ends the whole job within seconds, with that rank's error printed once.

Why: a rank that raises (reward scoring, data, generation, the weight push) leaves its peers waiting in
the next collective. gloo notices a dead peer's closed socket, NCCL does not: its ranks wait for the
collective timeout (30 minutes by default), and torchrun only kills the workers of its own node.

How: the rendezvous store (torchrun's, reached through MASTER_ADDR / MASTER_PORT) is the job's shared
blackboard. The first rank to fail counts itself in with an atomic `add`, writes its rank, prints its
traceback and exits with status 1. Every rank polls the blackboard from a daemon thread (`poll_s`,
default 0.5 s); a rank that sees a failure prints one line naming the failed rank and exits with status
1 at once, from whatever wait it is in. A rank whose own error follows another's (gloo's "connection
closed by peer") prints that one line too, not a second traceback; a first failure that is only a lost
peer (a rank killed without a word: SIGKILL, the OOM killer) prints one line saying so (`--debug` for the
traceback). Exits use `os._exit`: interpreter
teardown can hang on a communicator or a thread that still waits on the dead peer. A single-rank run
has no peers: its errors propagate unchanged.

A stop that is no failure (a second Ctrl-C or SIGTERM, `interrupt.Interrupted`) is recorded as one: the other
ranks end with a line saying whose stop they follow (`rank 1 (rollout rank 0) stops with rank 0 (trainer rank
0), stopped by Ctrl-C`) and the signal's exit status, not a "failed". When the store itself stops answering,
no rank can say which failed: if this process's parent changed meanwhile, the launcher (torchrun, whose agent
hosts the store and started this rank) was killed, and the line says so; else it names the store's address.

A rank killed without a word (SIGKILL, the OOM killer) writes nothing here. With `watch_peers` (split
placement, whose sides wait by polling the store, not in a collective that would fail on the dead peer's
socket) each rank also looks up its same-node peers' processes by pid at each poll (peers.py): the first rank
to find one dead records the death here as that rank's failure, and every rank ends with one line naming it
(`rank 0 (trainer rank 0) stops: rank 1 (rollout rank 0) died ...`). torchrun's SIGTERM to the survivors comes
first (within its 0.1 s monitor interval): a stop's signal handler asks `end_if_lost` before it promises a
checkpoint, so the answer to a dead peer is that line, at once, never a stop that waits for torchrun's
SIGKILL.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch.distributed as dist

from ..errors import FlashdapoError, debug_requested, user_error_line
from .interrupt import Interrupted, interruption_of, signal_name
from .peers import Peers

_EXIT_STATUS = 1

DIED = (
    "its process ended without a word: killed by a signal, e.g. SIGKILL or the out-of-memory killer); ending "
    "without saving a checkpoint (the newest one stands; resume with --checkpoint.resume auto")
"""What a death line says after naming the dead rank."""

_EXIT_LOCK = threading.Lock()
"""Held by the thread that ends the process: one closing line per process, whichever watcher (the failure
watch here, the launcher watch of trainer/state/rundir.py) or error path gets there first."""


def _key(name: str) -> str:
    # One namespace per (elastic) attempt: a restarted worker group must not read the last one's failure.
    return f"flashdapo/failfast/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


@dataclass
class FailFast:
    """A rank's view of the job's failure state; `watch` starts polling, `fail` reports this rank."""

    rank: int
    store: dist.Store | None
    poll_s: float = 0.5
    role: str = ""
    """In split placement, how messages name this rank's side ('rollout rank 0'); empty when co-located."""
    parent_pid: int = field(default_factory=os.getppid)
    """The process that started this rank (torchrun's agent): another one later means the launcher is gone."""
    peers: Peers | None = None
    """With watch_peers: this rank's watch over the other ranks' processes (peers.py), else None."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def connect(cls, rank: int, world_size: int, poll_s: float = 0.5, role: str = "",
                watch_peers: bool = False) -> FailFast:
        """Connect to the rendezvous store (a client of its own); no store for one rank without peers.
        `rank`, `world_size`: the whole launch's (in split placement too: one blackboard for both sides).
        `watch_peers`: publish this process's pid and look up the other ranks' at each poll (peers.py)."""
        if world_size == 1 or "MASTER_ADDR" not in os.environ:
            return cls(rank, None, poll_s, role)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        failfast = cls(rank, store, poll_s, role)
        if watch_peers:
            failfast.peers = Peers(store, rank, failfast._me, range(world_size))
            failfast.peers.publish()
        return failfast

    @property
    def _me(self) -> str:
        return f"rank {self.rank}" + (f" ({self.role})" if self.role else "")

    def watch(self) -> None:
        """Start the daemon thread that ends this process when another rank has failed."""
        if self.store is not None and self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="flashdapo-failfast", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop watching (a clean end: before the process group and its store go away); with watch_peers, tell
        the other ranks that this one's exit from now on is no death."""
        self._stop.set()
        if self.peers is not None:
            self.peers.leave()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def end(self, error: BaseException | None) -> None:
        """The end of this process's distributed life: after an error, report it to the other ranks (with
        peers this ends the process: `fail`) and drop the process group without meeting them; without one,
        stop watching and meet the peers to close the group (mesh.shutdown)."""
        from .mesh import shutdown

        if error is not None:
            self.fail(error)
            shutdown(synchronize=False)
        else:
            self.close()
            shutdown()

    def failed_rank(self) -> int | None:
        """The rank that failed first, if any has."""
        if self.store is None or not self.store.check([_key("rank")]):
            return None
        return int(self.store.get(_key("rank")))

    def fail(self, err: BaseException) -> None:
        """Report this rank's exception and end the process (status 1). The first failure of the job prints
        its traceback; a later one prints a line naming the first. Returns only without peers."""
        if self.store is None:
            return
        # a second Ctrl-C that cut a save short: the stop, not the save's error
        err = interruption_of(err) or err
        # an error after a peer's death (its closed socket) follows that death
        if not isinstance(err, Interrupted):
            try:
                self._find_death(wait_s=2.0 if lost_peer_line(err) else 0.0)
            except Exception:  # the store is gone: said below
                pass
        first = self._count_in(err)
        with _EXIT_LOCK:  # the watcher thread may be exiting already: one message per process
            self._stop.set()
            line = None if debug_requested() else user_error_line(err) or lost_peer_line(err)
            # this error is the store's loss
            if first is None and self.launcher_gone() and not debug_requested():
                print(self.store_gone_line(), file=sys.stderr, flush=True)
                _exit()
            first = True if first is None else first  # no store, no peers to defer to: this error in full
            if first and line is not None:  # an error the user can fix: its one line (flashdapo/errors.py)
                print(f"{line} ({self._me}; stopping every rank)", file=sys.stderr, flush=True)
            elif first:
                print(f"flashdapo: {self._me} failed; stopping every rank", file=sys.stderr, flush=True)
                traceback.print_exception(err, file=sys.stderr)
            elif not (isinstance(err, FlashdapoError) and err.every_rank):  # raised together: said once above
                print(f"flashdapo: {self._me} stops ({type(err).__name__}) after {self._first_words()}",
                      file=sys.stderr, flush=True)
            _exit(
                getattr(err, "exit_status", _EXIT_STATUS) if isinstance(err, FlashdapoError) else _EXIT_STATUS
            )

    def _count_in(self, err: BaseException) -> bool | None:
        """Whether this rank failed first (None: the store no longer answers). A stop on a signal is marked as
        one (`stop`: its number) before `rank`, which the other ranks poll, is written."""
        try:
            first = self.store.add(_key("count"), 1) == 1
            if first:
                self.store.set(_key("who"), self._me.removeprefix("rank "))
                if isinstance(err, Interrupted):
                    self.store.set(_key("stop"), str(err.exit_status - 128))
                self.store.set(_key("rank"), str(self.rank))
            return first
        # the store is gone with its host: report this error in full (or the launcher's loss)
        except Exception:
            return None

    def _find_death(self, wait_s: float = 0.0) -> None:
        """With watch_peers and no failure recorded yet: record a peer found dead (its process gone without a
        word) as the job's first failure, for the ranks that cannot see its pid. `wait_s`: look for that long
        (a collective fails on the dead peer's closed socket an instant before its process is seen gone)."""
        if self.peers is None:
            return
        deadline = time.monotonic() + wait_s
        while self.failed_rank() is None:
            dead = self.peers.dead()
            if dead is not None:
                # else another rank's failure (or this death) came first
                if self.store.add(_key("count"), 1) == 1:
                    self.store.set(_key("who"), dead.name.removeprefix("rank "))
                    self.store.set(_key("died"), "1")
                    self.store.set(_key("rank"), str(dead.rank))
                return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _first(self) -> tuple[str, int | None, bool]:
        """Who failed (or stopped) first, as 'rank 0 (trainer rank 0)', the signal of a stop (else None), and
        whether it died without a word (found by pid: peers.py)."""
        who = self.store.get(_key("who" if self.store.check([_key("who")]) else "rank")).decode()
        stop = int(self.store.get(_key("stop"))) if self.store.check([_key("stop")]) else None
        return f"rank {who}", stop, self.store.check([_key("died")])

    def _first_words(self) -> str:
        try:
            who, stop, died = self._first()
        except Exception:
            return "the job's store stopped answering"
        if died:
            return f"{who} died ({DIED})"
        if stop is None:
            return f"{who} failed (its error is above)"
        return f"{who} was stopped by {signal_name(stop)}"

    def launcher_gone(self) -> bool:
        """Whether the process that started this rank has gone (this rank was handed to another parent): under
        torchrun, the agent, which hosts the rendezvous store, was killed (SIGKILL, the OOM killer)."""
        return os.getppid() != self.parent_pid

    def store_gone_line(self) -> str:
        """The one line when the store no longer answers: what is known of why."""
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        if self.launcher_gone():
            why = (
                f"the launcher (pid {self.parent_pid}, torchrun's agent, which started this rank) was "
                "killed, and "
                f"the job's store ({where}) with it; no rank reported an error")
        else:
            why = (
                f"the job's store ({where}) stopped answering: its host (torchrun's agent on the first node) "
                "is "
                "gone; no rank reported an error before")
        return f"flashdapo: {self._me} stops: {why}; resume with --checkpoint.resume auto"

    def verdict(self) -> tuple[str, int] | None:
        """The line and exit status that end this process when another rank has failed, stopped on a second
        signal or (watch_peers) died, or when the store is gone; None while the job goes on."""
        try:
            self._find_death()
            if self.failed_rank() is None:
                return None
            who, stop, died = self._first()
        except Exception:  # the store's host (the launcher) is gone: so is the job
            return self.store_gone_line(), _EXIT_STATUS
        if died:
            return f"flashdapo: {self._me} stops: {who} died ({DIED})", _EXIT_STATUS
        if stop is None:
            return f"flashdapo: {self._me} stops: {who} failed (its error is above)", _EXIT_STATUS
        return f"flashdapo: {self._me} stops with {who}, stopped by {signal_name(stop)}", 128 + stop

    def end_if_lost(self) -> bool:
        """For a stop's signal handler, before it promises a checkpoint: if the job is ending (another rank
        failed or died: torchrun signals the survivors of a dead rank), end this process now with the poll's
        line, and return True (also when another thread is ending it already): the stop's checkpoint needs
        the other ranks and would never be written. False while the job goes on."""
        if self.store is None or self._stop.is_set():
            return False
        found = self.verdict()
        if found is None:
            return False
        exit_with_line(*found)
        return True  # another thread holds the exit: its line is the one said

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            found = self.verdict()
            if found is not None and _EXIT_LOCK.acquire(blocking=False):
                if self._stop.is_set():  # a clean close raced the poll
                    _EXIT_LOCK.release()
                    return
                print(found[0], file=sys.stderr, flush=True)
                _exit(found[1])


_LOST_PEER = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
              "remote process exited", "socket closed")
"""How gloo (and NCCL, where it notices) words a collective whose peer process is gone."""


def lost_peer_line(err: BaseException) -> str | None:
    """One line for a collective that failed because a peer process vanished without reporting (SIGKILL, the
    OOM killer): the peer has no error of its own to show and this rank's traceback is gloo's, not a clue."""
    text = str(err).lower()
    if not isinstance(err, RuntimeError) or not any(marker in text for marker in _LOST_PEER):
        return None
    reason = next(marker for marker in _LOST_PEER if marker in text)
    return (
        "flashdapo: error: a collective lost its peer (" + reason + "): another rank died without reporting "
        "an error (killed by a signal, e.g. out of memory; the launcher's summary below names it and its "
        "exit "
        "code); resume with --checkpoint.resume auto")


def exit_with_line(line: str, status: int = _EXIT_STATUS) -> None:
    """Print `line` and end the process, unless another thread is ending it already (then return at once: its
    own line is the one said)."""
    if not _EXIT_LOCK.acquire(blocking=False):
        return
    print(line, file=sys.stderr, flush=True)
    _exit(status)


def _exit(status: int = _EXIT_STATUS) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


__all__ = ["FailFast", "exit_with_line"]

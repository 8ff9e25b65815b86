"""Is a peer rank's process alive, and which rank died? For peers on this node, answered from its pid at once.

Why: a rank killed without a word (SIGKILL, the out-of-memory killer) writes nothing on fail-fast's blackboard
(failfast.py). Its peers learn of it only from a collective that fails on its closed socket, or, where a side
waits by polling the store (split placement, roles.py), once its liveness counter has stood still for 60 s.
Meanwhile torchrun answers the death with SIGTERM to the survivors, whose stop would promise a checkpoint that
can no longer be saved, and SIGKILLs them 30 s later.

How: each rank publishes its process's identity in the rendezvous store at start (`Peers.publish`): its pid,
the pid's start time (a recycled pid is another process), where that pid means something (this machine's boot
and pid namespace) and how messages name the rank. A peer published from the same place is looked up in /proc:
gone, another process under its pid, or a zombie its parent has not reaped yet means dead. A rank that ends in
order says so first (`mark_left`): its exit is no death. Peers on other nodes cannot be seen from here (the
ranks of their own node see them); nor can a rank that died before publishing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist


def _key(name: str) -> str:
    # One namespace per (elastic) attempt, as fail-fast's: a restarted worker group has new processes.
    return f"flashdapo/peers/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def this_place() -> str:
    """Where a pid of this process's means the same process: the machine's boot and this pid namespace (''
    where /proc cannot say: then no peer is checked by pid)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None if there is no such
    process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces and parentheses


@dataclass(frozen=True)
class ProcessId:
    """A rank's process: its rank (the launch's), pid, the pid's start time (clock ticks after boot), where
    the pid is valid, and how messages name the rank ('rank 1 (rollout rank 0)')."""

    rank: int
    pid: int
    started: int
    place: str
    name: str

    @classmethod
    def of_this_process(cls, rank: int, name: str) -> ProcessId:
        fields = _stat(os.getpid())
        return cls(rank, os.getpid(), int(fields[19]) if fields else -1, this_place(), name)

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "pid": self.pid, "started": self.started, "place": self.place,
                           "name": self.name})

    @classmethod
    def from_json(cls, text: str | bytes) -> ProcessId:
        plain = json.loads(text)
        return cls(int(plain["rank"]), int(plain["pid"]), int(plain["started"]), str(plain["place"]),
                   str(plain["name"]))

    def checkable(self) -> bool:
        """Whether this process can be looked up from here (the same machine and pid namespace)."""
        return bool(self.place) and self.started >= 0 and self.place == this_place()

    def alive(self) -> bool:
        """Whether it still runs (checkable ones only): its pid exists, is no zombie, and started when it
        did."""
        fields = _stat(self.pid)
        return fields is not None and fields[0] not in ("Z", "X", "x") and int(fields[19]) == self.started


def publish(store: dist.Store, process: ProcessId) -> None:
    """Write a rank's process identity for the other ranks to look up."""
    store.set(_key(f"pid/{process.rank}"), process.to_json())


def mark_left(store: dist.Store, rank: int) -> None:
    """Say that `rank` ends in order (a clean end, a stop it follows): its exit from now on is no death."""
    try:
        store.set(_key(f"left/{rank}"), "1")
    except Exception:  # the store went with the job: nobody is left to watch this rank
        pass


class Peers:
    """One rank's watch over the others' processes, through the rendezvous store: `publish` this rank, then
    `dead` names a peer that has died without leaving (`leave`, `mark_left`)."""

    def __init__(self, store: dist.Store, rank: int, name: str, ranks: Iterable[int]):
        self.store, self.rank, self.name = store, rank, name
        self.watched = sorted(r for r in ranks if r != rank)
        """The other ranks (global ranks of the launch)."""
        self._ids: dict[int, ProcessId] = {}
        self._unseen: set[int] = set()
        """Ranks that left, or that run elsewhere: never looked up again."""

    def publish(self) -> None:
        """Write this process's identity for the other ranks to look up."""
        publish(self.store, ProcessId.of_this_process(self.rank, self.name))

    def leave(self) -> None:
        """This rank ends in order now (mark_left)."""
        mark_left(self.store, self.rank)

    def dead(self) -> ProcessId | None:
        """The first watched peer on this node whose process has ended without leaving, if any. Peers that
        have not published yet are looked up again at the next call."""
        for rank in self.watched:
            if rank in self._unseen:
                continue
            peer = self._ids.get(rank) or self._look_up(rank)
            if peer is None or peer.alive():
                continue
            # read after its death: a leaving rank wrote it before
            if self.store.check([_key(f"left/{rank}")]):
                self._unseen.add(rank)
                continue
            return peer
        return None

    def _look_up(self, rank: int) -> ProcessId | None:
        if not self.store.check([_key(f"pid/{rank}")]):
            return None
        peer = ProcessId.from_json(self.store.get(_key(f"pid/{rank}")))
        if not peer.checkable():
            self._unseen.add(rank)
            return None
        self._ids[rank] = peer
        return peer


__all__ = ["Peers", "ProcessId", "mark_left", "publish", "this_place"]

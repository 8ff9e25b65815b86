"""Roles of split placement (rollout.placement=split): trainer ranks and rollout ranks under one torchrun.

The choices, before the code:

- **Partitioned default groups.** Ranks 0..T-1 train, ranks T..W-1 generate. Each side initializes its own
  default process group over a prefixed view of torchrun's store (`flashdapo/trainer`, `flashdapo/rollout`),
  with partition ranks 0..T-1 and 0..R-1. So FSDP2, the collectives (`collectives.py`) and the dealing of
  groups see the trainer side alone, and an engine that builds groups over the default group (vLLM's
  external launcher) sees the rollout side alone: neither side enters the other's collectives.
- **Bridges** are process groups built directly from the store, never registered as torch.distributed
  groups (no `dist.*` call takes them; their own `broadcast/send/recv` with their own ranks do):
  `ctl`, gloo over all W ranks in global rank order, for the batches; `weights`, trainer rank 0 plus every
  rollout rank (bridge rank 0 is trainer rank 0, bridge rank 1 + i is rollout rank i), gloo on CPU and NCCL
  on GPU, for the weights. NCCL takes tensors on the calling rank's own CUDA device only, so the bridges say
  which device the weights bridge's tensors must be on (`Bridges.weights_device`): its users allocate there.
- **Waits poll, never block in a collective.** A side that waits for the other (a batch, a weight version)
  polls a store key (`wait_key`) instead of sitting in a collective with a timeout, so a generation of any
  length trips nothing; the data moves only once the key says the sender is there. While it polls it reads
  the peers' liveness counters (each rank's `Liveness` thread bumps its own every second): a peer whose
  counter stops for `stale_s` (a stopped or wedged process) ends the job in one line naming its rank and
  role. The weights bridge's broadcasts run asynchronously under the same poll, so a member that stops inside
  one is named too. A peer that dies outright is caught sooner by fail-fast (`failfast.py`), which watches
  the same store unprefixed.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import FlashdapoError
from .peers import mark_left

ROLES = ("colocated", "trainer", "rollout")


class PeerHungError(FlashdapoError, RuntimeError):
    """A rank of the other side stopped answering while this one waited for it."""


def _key(name: str) -> str:
    # One namespace per (elastic) attempt, as fail-fast's: a restarted worker group must not read stale keys.
    return f"flashdapo/split/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


@dataclass(frozen=True)
class Layout:
    """Which global ranks train and which generate: the first `trainers`, then `rollouts`."""

    trainers: int
    rollouts: int

    @property
    def world_size(self) -> int:
        return self.trainers + self.rollouts

    def role(self, global_rank: int) -> str:
        return "trainer" if global_rank < self.trainers else "rollout"

    def partition(self, global_rank: int) -> tuple[str, int, int]:
        """(role, rank in its partition, partition size) of a global rank."""
        if global_rank < self.trainers:
            return "trainer", global_rank, self.trainers
        return "rollout", global_rank - self.trainers, self.rollouts

    def describe(self, global_rank: int) -> str:
        """'rank 2 (rollout rank 0)': how a message names a rank."""
        role, rank, _ = self.partition(global_rank)
        return f"rank {global_rank} ({role} rank {rank})"

    @property
    def weights_members(self) -> list[int]:
        """Global ranks of the weights bridge, in bridge rank order: trainer rank 0, then the rollout
        ranks."""
        return [0, *range(self.trainers, self.world_size)]


def connect_store(timeout_s: float = 60.0) -> dist.Store:
    """A client of torchrun's rendezvous store (MASTER_ADDR / MASTER_PORT)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def init_partition(layout: Layout, global_rank: int, store: dist.Store, backend: str, timeout_s: float,
                   device_id: torch.device | None = None) -> tuple[str, int, int]:
    """Initialize this rank's side as the default process group; (role, partition rank, partition size)."""
    role, rank, size = layout.partition(global_rank)
    dist.init_process_group(backend, store=dist.PrefixStore(_key(role), store), rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id)
    return role, rank, size


STOP_KEY = "stop"
"""Set by trainer rank 0 when the trainer side stops on a signal (Ctrl-C, SIGTERM), its checkpoint saved: the
signal's number. The rollout ranks' Liveness threads read it and end their process quietly."""


class Liveness:
    """A daemon thread bumping this rank's counter in the store every `every_s`: what `wait_key` reads to
    tell a slow peer (counting) from a stopped one (not). With `stop_line` (rollout ranks) it also ends this
    process, printing that line, once the trainer side has stopped on a signal (STOP_KEY): the rollout side
    has nothing to save, and neither a launcher's SIGKILL nor a lost peer is then the job's last word."""

    def __init__(self, store: dist.Store, global_rank: int, every_s: float = 1.0,
                 stop_line: str | None = None):
        self.store, self.key, self.every_s = store, _key(f"alive/{global_rank}"), every_s
        self.global_rank = global_rank
        self.stop_line = stop_line
        self._stop = threading.Event()
        self._exiting = threading.Lock()
        self.store.add(self.key, 1)
        self._thread = threading.Thread(target=self._beat, name="flashdapo-liveness", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.store.add(self.key, 1)
            except Exception:  # the store went with the job: fail-fast reports it
                return
            self.stop_if_announced()

    def stop_if_announced(self) -> None:
        """With `stop_line`: end this process with that line and the signal's exit status if the trainer side
        has stopped on a signal (STOP_KEY). Also called on an error: one that follows the trainer side's stop
        (a batch sent to, or a weight bucket from, a trainer rank that has just exited) is that stop, no
        failure."""
        if self.stop_line is None:
            return
        with self._exiting:  # the beat and the main thread: one line; the second waits for the exit
            try:
                signum = int(self.store.get(_key(STOP_KEY))) if self.store.check([_key(STOP_KEY)]) else 0
            except Exception:  # the store went with the job: fail-fast reports it
                return
            if signum:
                # an end in order: the trainer side's watch sees no death
                mark_left(self.store, self.global_rank)
                print(self.stop_line, file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(128 + signum)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Bridges:
    """This rank's links to the other side: the unprefixed store, the control and the weights bridges."""

    layout: Layout
    global_rank: int
    store: dist.Store
    ctl: dist.ProcessGroup
    weights: dist.ProcessGroup | None
    """None on trainer ranks other than 0."""
    weights_device: torch.device = torch.device("cpu")
    """Where the weights bridge's tensors live: this rank's CUDA device when the bridge is NCCL, else the CPU.
    A thread that uses the bridge must make it its current device first (a new thread starts on device 0)."""
    stale_s: float = 60.0
    poll_s: float = 0.02

    @property
    def weights_rank(self) -> int:
        """This rank's rank in the weights bridge (0: trainer rank 0)."""
        return self.layout.weights_members.index(self.global_rank)

    def set(self, name: str, value: bytes | str) -> None:
        self.store.set(_key(name), value)

    def get(self, name: str) -> bytes:
        return self.store.get(_key(name))

    def delete(self, name: str) -> None:
        self.store.delete_key(_key(name))

    def announce_stop(self, signum: int) -> None:
        """Trainer rank 0, its stop's checkpoint saved: the rollout ranks end now (Liveness, STOP_KEY)."""
        self.set(STOP_KEY, str(int(signum)))

    def wait_key(self, name: str, peers: list[int], what: str) -> float:
        """Poll until key `name` exists; seconds waited. `peers` (global ranks) must keep their liveness
        counters moving meanwhile: one that stops for stale_s raises PeerHungError naming it and `what`."""
        return self._poll(lambda: self.store.check([_key(name)]), peers, what)

    def arrive(self, name: str) -> None:
        """Count this rank in at counter `name` (what a peer's `wait_count` waits for)."""
        self.store.add(_key(name), 1)

    def wait_count(self, name: str, count: int, peers: list[int], what: str) -> float:
        """Poll until `count` ranks have `arrive`d at `name`, reading `peers`' liveness as `wait_key` does.
        Before a bridge collective: a peer stopped outside it is named in one line, not found by the
        collective's timeout."""
        return self._poll(lambda: self.store.add(_key(name), 0) >= count, peers, what)

    def wait_until(self, done: Callable[[], bool], peers: list[int], what: str) -> float:
        """Poll `done` until it holds, reading `peers`' liveness as `wait_key` does; seconds waited. For a
        wait on something of this process (a receiver thread's progress) that a stopped peer would hold up."""
        return self._poll(done, peers, what)

    def _poll(self, done, peers: list[int], what: str, pause: Callable[[], object] | None = None) -> float:
        """Until `done()`: read `peers`' liveness counters between pauses (`pause`, else poll_s of sleep)."""
        start = time.perf_counter()
        seen = {p: (-1, start) for p in peers}
        while not done():
            now = time.perf_counter()
            for p in peers:
                count = self.store.add(_key(f"alive/{p}"), 0)
                if count != seen[p][0]:
                    seen[p] = (count, now)
                elif now - seen[p][1] > self.stale_s:
                    raise PeerHungError(
                        f"{self.layout.describe(p)} has not answered for {self.stale_s:.0f} s while "
                        f"{self.layout.describe(self.global_rank)} waited for {what}: it is stopped "
                        "or hung; resume with --checkpoint.resume auto")
            if pause is None:
                time.sleep(self.poll_s)
            else:
                pause()
        return time.perf_counter() - start

    def send_bytes(self, payload: bytes, dst: int, tag: int, what: str = "a message") -> None:
        """`payload` to global rank `dst` over the control bridge (its length first), reading `dst`'s liveness
        while the send is in flight (a peer stopped before it receives is named, not found by the timeout)."""
        _stop_here_for_test("send")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(
            0, dtype=torch.uint8)
        self._finish(self.ctl.send([torch.tensor([len(payload)], dtype=torch.int64)], dst, tag), [dst], what)
        if len(payload):
            self._finish(self.ctl.send([data], dst, tag), [dst], what)

    def recv_bytes(self, src: int, tag: int, what: str = "a message") -> bytes:
        """What global rank `src` sent with `send_bytes` and `tag`. The receive runs while this rank reads
        `src`'s liveness: a sender stopped between announcing the message and sending it is named after
        stale_s."""
        size = torch.zeros(1, dtype=torch.int64)
        self._finish(self.ctl.recv([size], src, tag), [src], what)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        if len(data):
            self._finish(self.ctl.recv([data], src, tag), [src], what)
        return data.numpy().tobytes()

    def _finish(self, work, peers: list[int], what: str) -> None:
        """Wait for a point-to-point `work` while polling `peers`' liveness. Gloo's send/recv works report
        is_completed() only once wait() has returned, so the wait runs on a helper thread (left blocked,
        daemon, if the peer hung: the process is about to end with PeerHungError)."""
        done, errors = threading.Event(), []

        def wait() -> None:
            try:
                work.wait()
            except BaseException as err:  # re-raised on the caller's thread
                errors.append(err)
            finally:
                done.set()

        threading.Thread(target=wait, name="flashdapo-bridge-wait", daemon=True).start()
        # wakes as the transfer ends
        self._poll(done.is_set, peers, what, pause=lambda: done.wait(self.poll_s))
        if errors:
            raise errors[0]  # the transfer's own error (a peer that died: its closed socket)

    def broadcast_weights(self, tensor: torch.Tensor, what: str = "a bucket of the weights") -> None:
        """Trainer rank 0's `tensor` into every rollout rank's (same shape and dtype, on `weights_device`),
        over the weights bridge. The broadcast runs asynchronously while this rank polls the other members'
        liveness: a member that stops inside it (SIGSTOP, a wedged process) is named after stale_s in one line
        (PeerHungError), not found by the bridge's collective timeout."""
        _stop_here_for_test("push")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self.weights.broadcast([tensor], options)
        members = self.layout.weights_members
        peers = members[1:] if self.global_rank == members[0] else members[:1]
        self._poll(work.is_completed, peers, what)
        work.wait()  # raises the collective's own error (a peer that died: its closed socket)


def _bridge_group(store: dist.Store, name: str, rank: int, size: int, device: torch.device,
                  timeout_s: float) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore(_key(name), store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


STOP_ENV = "FLASHDAPO_SPLIT_STOP_IN"
"""Test hook (fault injection): `<global rank>:<where>:<n>` makes that rank SIGSTOP itself (every thread, its
liveness beat included: a hung process) at its n-th pass through `where` (1-based); `push`: about to join a
bucket broadcast of the weights push; `send`: about to send a message over the control bridge (a rollout rank:
a batch whose ready key is set)."""


def _stop_here_for_test(where: str) -> None:
    spec = os.environ.get(STOP_ENV, "")
    if not spec:
        return
    rank, place, nth = spec.split(":")
    if place != where or int(rank) != int(os.environ.get("RANK", "-1")):
        return
    _PASSES[where] = _PASSES.get(where, 0) + 1
    if _PASSES[where] == int(nth):
        print(f"flashdapo: test hook {STOP_ENV}: rank {rank} stops itself in {where}", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


_PASSES: dict[str, int] = {}

STALE_ENV = "FLASHDAPO_SPLIT_STALE_S"
"""Test hook: the seconds without a liveness beat after which a waiting rank names its peer (default 60; read
within [2, 3600])."""


def connect_bridges(layout: Layout, global_rank: int, store: dist.Store, device: torch.device,
                    timeout_s: float = 1800.0, stale_s: float = 60.0) -> Bridges:
    """Build the control bridge (every rank) and the weights bridge (its members); every rank calls this once,
    after its partition is up. The bridges' own timeout only bounds a transfer whose key said both sides are
    there: waits for the other side are `wait_key`'s."""
    ctl = _bridge_group(store, "bridge/ctl", global_rank, layout.world_size, torch.device("cpu"), timeout_s)
    members = layout.weights_members
    weights = (_bridge_group(store, "bridge/weights", members.index(global_rank), len(members), device,
                             timeout_s) if global_rank in members else None)
    weights_device = device if device.type == "cuda" else torch.device("cpu")  # NCCL: this rank's GPU
    if os.environ.get(STALE_ENV):
        stale_s = min(max(float(os.environ[STALE_ENV]), 2.0), 3600.0)
    return Bridges(layout=layout, global_rank=global_rank, store=store, ctl=ctl, weights=weights,
                   weights_device=weights_device, stale_s=stale_s)


__all__ = ["Bridges", "Layout", "Liveness", "PeerHungError", "ROLES", "connect_bridges", "connect_store",
           "init_partition"]

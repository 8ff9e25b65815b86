"""A peer rank's process, looked up by pid (peers.py): alive while it runs, dead once killed (a zombie its parent has
not reaped yet included), never confused with another process under a recycled pid, never looked up from another
machine or pid namespace; a rank that left in order is no death. Then fail-fast's use of it: the first rank to find
a dead peer records the death, every rank's line names it, and a stop's signal handler ends the process with that
line instead of promising a checkpoint."""

import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch.distributed as dist

from flashdapo.distributed.failfast import FailFast
from flashdapo.distributed.interrupt import StopOnInterrupt
from flashdapo.distributed.peers import Peers, ProcessId, _stat, mark_left, publish, this_place

pytestmark = pytest.mark.skipif(not this_place(), reason="no /proc: peers are not looked up by pid here")


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _identity(proc: subprocess.Popen, rank: int, name: str) -> ProcessId:
    """What `proc` would publish as rank `rank`."""
    return ProcessId(rank, proc.pid, int(_stat(proc.pid)[19]), this_place(), name)


def test_this_process_is_alive_and_survives_the_store():
    me = ProcessId.of_this_process(3, "rank 3 (trainer rank 3)")
    assert me.checkable() and me.alive()
    assert ProcessId.from_json(me.to_json()) == me


def test_a_killed_process_is_dead_before_and_after_it_is_reaped():
    proc = _child()
    peer = _identity(proc, 1, "rank 1")
    assert peer.alive()
    proc.kill()
    deadline = time.monotonic() + 10
    while _stat(proc.pid)[0] not in "ZX" and time.monotonic() < deadline:  # a zombie until this parent waits for it
        time.sleep(0.01)
    assert not peer.alive()
    proc.wait()
    assert not peer.alive()


def test_a_recycled_pid_is_another_process():
    proc = _child()
    try:
        assert not replace(_identity(proc, 1, "rank 1"), started=_identity(proc, 1, "rank 1").started - 1).alive()
    finally:
        proc.kill()
        proc.wait()


def test_a_process_of_another_machine_or_pid_namespace_is_never_looked_up():
    store = _store()
    elsewhere = replace(ProcessId.of_this_process(1, "rank 1 (rollout rank 0)"), pid=2 ** 22 + 1, place="other-boot")
    assert not elsewhere.checkable()
    publish(store, elsewhere)
    assert Peers(store, 0, "rank 0", range(2)).dead() is None  # its pid names no process here: still not dead


def test_peers_names_the_dead_rank_once_it_has_published_and_not_one_that_left():
    store = _store()
    procs = [_child(), _child()]
    try:
        watch = Peers(store, 0, "rank 0 (trainer rank 0)", range(3))
        watch.publish()
        assert watch.dead() is None  # nobody else published yet
        for rank, proc in enumerate(procs, start=1):
            publish(store, _identity(proc, rank, f"rank {rank} (rollout rank {rank - 1})"))
        assert watch.dead() is None
        mark_left(store, 1)  # rank 1 ends in order ...
        procs[0].kill()
        procs[0].wait()
        assert watch.dead() is None  # ... so its exit is no death
        procs[1].kill()
        procs[1].wait()
        dead = watch.dead()
        assert dead is not None and (dead.rank, dead.name) == (2, "rank 2 (rollout rank 1)")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _failfast(store: dist.Store, rank: int, role: str, world: int = 2) -> FailFast:
    failfast = FailFast(rank, store, role=role)
    failfast.peers = Peers(store, rank, failfast._me, range(world))
    failfast.peers.publish()
    return failfast


def test_the_first_rank_to_find_a_dead_peer_records_it_and_every_line_names_it():
    """Three ranks: rank 2 (a child process here) dies without a word; rank 0 finds it by pid and records it as the
    job's first failure; rank 1 (another node, say) reads that record: both lines name rank 2 and say that it
    ends without saving a checkpoint."""
    store = _store()
    proc = _child()
    try:
        trainers = [_failfast(store, r, f"trainer rank {r}", world=3) for r in (0, 1)]
        publish(store, _identity(proc, 2, "rank 2 (rollout rank 0)"))
        assert trainers[0].verdict() is None and trainers[1].verdict() is None
        proc.kill()
        proc.wait()
        trainers[1].peers = None  # it cannot see rank 2's pid
        line, status = trainers[0].verdict()
        assert line.startswith("flashdapo: rank 0 (trainer rank 0) stops: rank 2 (rollout rank 0) died (its process "
                               "ended without a word") and status == 1, line
        assert "ending without saving a checkpoint" in line and "--checkpoint.resume auto" in line
        assert trainers[0].failed_rank() == 2
        line, status = trainers[1].verdict()
        assert line.startswith("flashdapo: rank 1 (trainer rank 1) stops: rank 2 (rollout rank 0) died") and status == 1
        assert trainers[1]._first_words().startswith("rank 2 (rollout rank 0) died (")
    finally:
        proc.kill()
        proc.wait()


def test_a_reported_failure_is_not_taken_for_a_death():
    """A rank that fails in order records its error, then exits: its peers say it failed, not that it died."""
    store = _store()
    proc = _child()
    try:
        me = _failfast(store, 0, "trainer rank 0")
        publish(store, _identity(proc, 1, "rank 1 (rollout rank 0)"))
        other = FailFast(1, store, role="rollout rank 0")
        other._count_in(RuntimeError("injected"))
        proc.kill()
        proc.wait()
        assert me.verdict()[0] == "flashdapo: rank 0 (trainer rank 0) stops: rank 1 (rollout rank 0) failed (its error " \
                                  "is above)"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("peer_dead", [False, True])
def test_a_stop_promises_its_checkpoint_only_while_no_peer_is_lost(peer_dead, monkeypatch, capfd):
    """torchrun's SIGTERM after a rank died: the handler asks fail-fast first, which ends the process with the line
    naming the dead rank (here: records the exit) and no stop line promising a checkpoint is written. Without a
    dead peer, the stop's usual notice."""
    from flashdapo.distributed import failfast as module

    store = _store()
    proc = _child()
    exits = []
    monkeypatch.setattr(module, "_exit", lambda status=1: exits.append(status))
    try:
        me = _failfast(store, 0, "trainer rank 0")
        publish(store, _identity(proc, 1, "rank 1 (rollout rank 0)"))
        if peer_dead:
            proc.kill()
            proc.wait()
        stop = StopOnInterrupt(lambda: None)
        stop.phase, stop.is_main, stop.lost = "step 3", True, me.end_if_lost
        stop._handle(signal.SIGTERM, None)
        err = capfd.readouterr().err
        assert stop.requested
        if peer_dead:
            assert exits == [1] and "its checkpoint is saved" not in err, err
            assert "flashdapo: rank 0 (trainer rank 0) stops: rank 1 (rollout rank 0) died" in err, err
        else:
            assert exits == [] and "stopping after step 3 (its checkpoint is saved then)" in err, err
    finally:
        if module._EXIT_LOCK.locked():
            module._EXIT_LOCK.release()  # held by the exit that did not happen
        proc.kill()
        proc.wait()


def test_a_rank_that_closes_in_order_is_no_death_to_its_peers():
    store = _store()
    proc = _child()
    try:
        me = _failfast(store, 0, "trainer rank 0")
        publish(store, _identity(proc, 1, "rank 1 (rollout rank 0)"))
        mark_left(store, 1)  # what FailFast.close (and a rollout rank following the trainer's stop) says
        proc.kill()
        proc.wait()
        assert me.verdict() is None and not me.end_if_lost()
    finally:
        proc.kill()
        proc.wait()

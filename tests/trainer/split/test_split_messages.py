"""What split placement says when a rank hangs, a launcher dies or a user stops it (docs/split.md, "Waits poll";
docs/failures.md), each in one line (gloo, torch engine, 1 trainer + 1 rollout rank):

- a SIGSTOPped rollout rank is named ('rank 1 (rollout rank 0) has not answered ...') once its liveness counter
  has stood still for the stale delay, before any collective timeout: the trainer's weight push waits for the
  receivers in the store (polling liveness) before each broadcast instead of sitting in the bridge's gloo
  broadcast (the delay shortened through the FLASHDAPO_SPLIT_STALE_S test hook);
- a rank that stops inside a bucket broadcast of the push (FLASHDAPO_SPLIT_STOP_IN fault injection) is named the
  same way: the broadcast runs asynchronously while each member polls the others' liveness; so is a rollout rank
  that stops between announcing a batch and sending it (the trainer's receive polls its liveness);
- SIGTERM to a rollout rank is one notice; Ctrl-C stops the trainer side after its step and the rollout side with
  it; a second Ctrl-C still ends the rollout side in one line, with no half-written checkpoint;
- a SIGKILLed torchrun agent (the launcher, host of the store) is named as such by every rank, not as 'rank ?';
- a SIGKILLed rank of either side is named by the other within seconds ('... died'), found by its pid: no stop
  answers torchrun's SIGTERM promising a checkpoint that is never written, nobody waits for torchrun's SIGKILL."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashdapo.distributed.roles import Bridges, Layout, PeerHungError
from tests.helpers.runs import ROOT, launch, rank_pid, split_cmd, subprocess_env, wait_rows

SCRIPTS = Path(__file__).parent / "scripts"
STALE_S = 5
LONG = ["--model.toy.sft-steps", "2", "--rollout.max-lag", "1", "--rollout.max-response-length", "24",
        "--trainer.total-steps", "40", "--checkpoint.save-every", "0"]
"""A run far longer than any test (its toy model barely warmed up: no test here reads what it learns): it ends only
by what the test does to it."""


def _kill(pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stopped_rollout_rank_is_named_before_any_collective_timeout(tmp_path):
    run_dir = tmp_path / "run"
    job = launch(split_cmd(run_dir, *LONG), tag=run_dir, FLASHDAPO_SPLIT_STALE_S=str(STALE_S))
    pid, stopped_at = None, None
    try:
        wait_rows(job, run_dir, 2)  # SIGSTOP the rollout rank once step 2 is logged
        pid = rank_pid(run_dir, 1)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        while time.time() < stopped_at + 200 and job.poll() is None and rank_pid(run_dir, 0) is not None:
            time.sleep(0.2)  # until the trainer rank ends: torchrun would wait 30 s to SIGKILL the stopped one
        took = time.time() - stopped_at
        _kill(pid)
        out = job.communicate(timeout=60)[0]
    finally:
        _kill(pid)
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert f"rank 1 (rollout rank 0) has not answered for {STALE_S} s while rank 0 (trainer rank 0) waited for" in out, \
        out[-4000:]
    assert "Timed out waiting" not in out and "killed by a signal" not in out, out[-4000:]
    assert took < 110, f"{took:.0f} s from the stop to the job's end:\n{out[-4000:]}"


PROMISES = (re.compile(r"stopping after step (\d+) \(its checkpoint is saved then\)"),
            re.compile(r"stopped at step (\d+) .*after saving its checkpoint"))
"""The lines that promise (or report) a step's checkpoint."""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("victim", "dead", "survivor"), [(1, "rank 1 (rollout rank 0)", "rank 0 (trainer rank 0)"),
                                                          (0, "rank 0 (trainer rank 0)", "rank 1 (rollout rank 0)")])
def test_a_sigkilled_rank_is_named_by_its_peer_within_seconds_with_no_checkpoint_promised(tmp_path, victim, dead,
                                                                                          survivor):
    """SIGKILL of one rank once step 2 is logged (as by the OOM killer: no word on the blackboard). torchrun SIGTERMs
    the survivor within its 0.1 s monitor interval; the survivor, which waits by polling the store (no collective to
    fail on the dead peer's socket), used to answer with a stop promising its step's checkpoint and wait until
    torchrun's SIGKILL 30 s later, naming nobody. It now finds the peer's pid gone and ends at once, in one line
    naming it; any checkpoint a line promises exists. The bound is generous: 1-3 s is usual on 2 cores."""
    run_dir = tmp_path / "run"
    job = launch(split_cmd(run_dir, *LONG), tag=run_dir)
    survivor_pid = None
    try:
        wait_rows(job, run_dir, 2)
        survivor_pid = rank_pid(run_dir, 1 - victim)
        _kill(rank_pid(run_dir, victim))
        killed_at = time.time()
        out = job.communicate(timeout=60)[0]
        took = time.time() - killed_at
    finally:
        _kill(survivor_pid)
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    ours = [line for line in out.splitlines() if line.startswith("flashdapo:")]
    said = [line for line in ours if line.startswith(f"flashdapo: {survivor} stops: {dead} died (")]
    assert len(said) == 1 and "ending without saving a checkpoint" in said[0], out[-4000:]
    for line in ours:
        for promise in PROMISES:
            if found := promise.search(line):
                step = int(found.group(1))
                assert (run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE").is_file(), \
                    f"promised, never written: {line}\n{out[-4000:]}"
    assert took < 15, f"{took:.1f} s from the SIGKILL to the job's end:\n{out[-4000:]}"


def _stop_in(run_dir: Path, stopped_rank: int, place: str) -> tuple[str, int]:
    """A long split run (stale delay 3 s, collective timeout 10 minutes) whose rank `stopped_rank` SIGSTOPs itself
    at its first pass through `place` (FLASHDAPO_SPLIT_STOP_IN): wait (up to 180 s) for the other rank to end, then
    kill the stopped one (else torchrun waits 30 s before its own SIGKILL of a stopped process). The job's output
    and exit status."""
    other = 1 - stopped_rank
    job = launch(split_cmd(run_dir, *LONG, "--trainer.setup-timeout-s", "600"), tag=run_dir,
                 FLASHDAPO_SPLIT_STALE_S="3", FLASHDAPO_SPLIT_STOP_IN=f"{stopped_rank}:{place}:1")
    stopped = alive = None
    try:
        deadline = time.time() + 180
        while time.time() < deadline and job.poll() is None:
            stopped, alive = stopped or rank_pid(run_dir, stopped_rank), alive or rank_pid(run_dir, other)
            if stopped is not None and alive is not None and rank_pid(run_dir, other) is None:  # seen, then gone
                break
            time.sleep(0.2)
        _kill(stopped)
        out = job.communicate(timeout=180)[0]
    finally:
        _kill(stopped)
        if job.poll() is None:
            job.kill()
    assert f"test hook FLASHDAPO_SPLIT_STOP_IN: rank {stopped_rank} stops itself in {place}" in out, out[-4000:]
    return out, job.returncode


@pytest.mark.distributed
@pytest.mark.slow
def test_a_trainer_stopped_inside_a_bucket_broadcast_is_named_by_the_rollout_side(tmp_path):
    """Trainer rank 0 SIGSTOPs itself in the first push (the starting weights), its header written and the rollout
    rank counted in at bucket 0, just before broadcasting it: the rollout rank's receiver is then inside the
    broadcast. The bridges' collective timeout is 10 minutes here, the test's own 3: only a liveness poll during
    the broadcast (the receiver's) or the wait for the weights (the main thread's) can end the job in time."""
    out, status = _stop_in(tmp_path / "run", 0, "push")
    named = "rank 0 (trainer rank 0) has not answered for 3 s while rank 1 (rollout rank 0) waited for "
    assert any(named + what in out for what in ("bucket 0 of the weights of step 0", "the weights of step 0")), \
        out[-4000:]
    assert status == 1, out[-4000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rollout_rank_stopped_between_announcing_a_batch_and_sending_it_is_named(tmp_path):
    """The rollout rank SIGSTOPs itself after setting batch 1's ready key, before its first byte: the trainer has
    passed the key's wait and sits in the receive. Seen once in a full run (gloo's 120 s receive timeout, a raw
    traceback): only a liveness poll during the receive names the stopped rank in time."""
    out, status = _stop_in(tmp_path / "run", 1, "send")
    assert "rank 1 (rollout rank 0) has not answered for 3 s while rank 0 (trainer rank 0) waited for batch 1" \
        in out, out[-4000:]
    assert "Timed out waiting" not in out, out[-4000:]
    assert status == 1, out[-4000:]


class _NeverDone:
    """A bridge broadcast whose peer stopped inside it: never completes."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("sat in the collective: only its timeout could end this wait")


class _StuckBridge:
    def broadcast(self, tensors, options):
        return _NeverDone()


@pytest.mark.parametrize(("me", "named"), [(0, "rank 1 (rollout rank 0)"), (1, "rank 0 (trainer rank 0)")])
def test_a_member_stopped_inside_a_bucket_broadcast_is_named_by_the_other_side(me, named):
    """Either side of the weights bridge, its bucket broadcast never completing (the other member SIGSTOPped inside
    it; gloo's root may finish a small bucket alone, so the end-to-end test stops the root): the other member's
    liveness counter stands still, and after stale_s the wait ends in PeerHungError naming it and the bucket."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    bridges = Bridges(layout=Layout(trainers=1, rollouts=1), global_rank=me, store=store, ctl=None,
                      weights=_StuckBridge(), stale_s=1.0)
    waiter = "rank 0 (trainer rank 0)" if me == 0 else "rank 1 (rollout rank 0)"
    with pytest.raises(PeerHungError, match=re.escape(f"{named} has not answered for 1 s while {waiter} waited for "
                                                      "bucket 3 of the weights of step 2")):
        bridges.broadcast_weights(torch.zeros(4), "bucket 3 of the weights of step 2")


class _BlockingWork:
    """A gloo send/recv whose peer stopped: wait() blocks (until the test releases it)."""

    def __init__(self, release):
        self.release = release

    def wait(self) -> None:
        self.release.wait()


class _StuckControl:
    def __init__(self, release):
        self.release = release

    def send(self, tensors, dst, tag):
        return _BlockingWork(self.release)

    def recv(self, tensors, src, tag):
        return _BlockingWork(self.release)


@pytest.mark.parametrize(("me", "named"), [(0, "rank 1 (rollout rank 0)"), (1, "rank 0 (trainer rank 0)")])
def test_a_peer_stopped_inside_a_control_message_is_named(me, named):
    """Trainer rank 0 receiving a batch whose sender stopped after announcing it, or the rollout rank sending to a
    stopped trainer: after stale_s the wait ends in PeerHungError naming the peer and the message."""
    release = threading.Event()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    bridges = Bridges(layout=Layout(trainers=1, rollouts=1), global_rank=me, store=store,
                      ctl=_StuckControl(release), weights=None, stale_s=1.0)
    waiter = "rank 0 (trainer rank 0)" if me == 0 else "rank 1 (rollout rank 0)"
    try:
        with pytest.raises(PeerHungError, match=re.escape(f"{named} has not answered for 1 s while {waiter} "
                                                          "waited for batch 4")):
            if me == 0:
                bridges.recv_bytes(src=1, tag=4, what="batch 4")
            else:
                bridges.send_bytes(b"abc", dst=0, tag=4, what="batch 4")
    finally:
        release.set()


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_to_a_rollout_rank_then_ctrl_c_stop_cleanly_in_one_line_each(tmp_path):
    """SIGTERM to the rollout worker only: one notice, the run goes on (the rollout side has no checkpoint of its
    own). Then Ctrl-C (SIGINT to the whole process group, as a terminal sends it): the trainer side stops after
    its step with a checkpoint, and the rollout rank ends with it at once: no 'killed by a signal' or 'failed'
    line, no launcher SIGKILL of a rollout rank that ignored the signal."""
    run_dir = tmp_path / "run"
    job = launch(split_cmd(run_dir, *LONG), tag=run_dir, new_session=True)
    try:
        wait_rows(job, run_dir, 2)
        os.kill(rank_pid(run_dir, 1), signal.SIGTERM)
        wait_rows(job, run_dir, 4)  # two more steps: the run went on
        os.killpg(job.pid, signal.SIGINT)
        stopped_at = time.time()
        out = job.communicate(timeout=120)[0]
        took = time.time() - stopped_at
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert "(a rollout rank) got SIGTERM: the rollout side saves nothing and stops when the trainer side does" in out
    found = [line for line in out.splitlines() if line.startswith("flashdapo: stopped at step")]
    assert len(found) == 1 and "by Ctrl-C, after saving its checkpoint" in found[0], out[-4000:]
    step = int(found[0].split()[4])
    assert (run_dir / "checkpoints" / f"step_{step:08d}").is_dir()
    assert "flashdapo: rank 1 (rollout rank 0) stops with the trainer side" in out, out[-4000:]
    for wrong in ("killed by a signal", "failed (its error is above)", "forcefully exiting", "Traceback (most recent "
                  "call last):\n  File \"/", "lost its peer"):
        assert wrong not in out.split("SignalException")[0], out[-4000:]
    assert took < 25, f"{took:.0f} s from Ctrl-C to the end:\n{out[-4000:]}"


@pytest.mark.distributed
@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_rollout_side_in_one_line_and_publishes_no_half_checkpoint(tmp_path):
    """Ctrl-C twice, 0.3 s apart (torchrun forwards the first as SIGINT, the second as SIGTERM to every rank): the
    trainer stops at once without a checkpoint of its step, and the rollout rank ends with it, saying whose stop it
    follows, not that a rank 'failed' (should the step end between the two, the first one's clean stop is as
    good). Every checkpoint and rollout part published is complete, whenever the second one landed."""
    run_dir = tmp_path / "run"
    job = launch(split_cmd(run_dir, *LONG[:-1], "1"), tag=run_dir, new_session=True)  # a checkpoint every step
    try:
        wait_rows(job, run_dir, 1)
        os.killpg(job.pid, signal.SIGINT)
        time.sleep(0.3)
        os.killpg(job.pid, signal.SIGINT)
        out = job.communicate(timeout=120)[0]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    ours = [line for line in out.splitlines() if line.startswith("flashdapo:")]
    assert any(line.startswith(("flashdapo: rank 1 (rollout rank 0) stops with rank 0 (trainer rank 0), stopped by "
                                "Ctrl-C", "flashdapo: rank 1 (rollout rank 0) stops with the trainer side"))
               for line in ours), out[-4000:]
    assert not any("failed" in line or "lost its peer" in line for line in ours), out[-4000:]
    assert rank_pid(run_dir, 1) is None and rank_pid(run_dir, 0) is None
    published = [p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp")]
    assert all((p / "COMPLETE").is_file() for p in published), published
    parts = [p for p in (run_dir / "split_rollout").glob("part_*") if not p.name.endswith(".tmp")]
    assert all((p / "COMPLETE").is_file() for p in parts), parts


def _gone(pid: int, within_s: float = 10) -> bool:
    """Whether process `pid` ends within `within_s` (a zombie that its new parent has not reaped yet has ended)."""
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.distributed
def test_a_killed_launcher_is_named_by_every_rank_not_as_an_unknown_rank():
    """SIGKILL of the launcher that hosts the store (torchrun's agent; here a miniature of it, scripts/
    launcher_killed.py: the same store, ranks in sessions of their own): each rank ends in one line saying the
    launcher (its pid) was killed, none says 'rank ?' or blames a peer."""
    job = subprocess.Popen([sys.executable, str(SCRIPTS / "launcher_killed.py")], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=subprocess_env(), cwd=ROOT)
    pids, head = [], []
    try:
        while len(pids) < 2 and (line := job.stdout.readline()):
            head.append(line)
            if line.startswith("ready "):
                pids.append(int(line.split()[2]))
        assert len(pids) == 2, "".join(head)
        os.kill(job.pid, signal.SIGKILL)
        out = "".join(head) + job.communicate(timeout=60)[0]  # the ranks hold the pipe: its end is theirs
    finally:
        for pid in pids:
            _kill(pid)
    ours = [line for line in out.splitlines() if line.startswith("flashdapo:")]
    for me in ("rank 0 (trainer rank 0)", "rank 1 (rollout rank 0)"):
        said = [line for line in ours if line.startswith(f"flashdapo: {me} stops: the launcher (pid {job.pid}, ")]
        assert len(said) == 1 and "was killed, and the job's store (127.0.0.1:" in said[0], out
    assert len(ours) == 2 and "was never stopped" not in out, out
    assert all(_gone(pid) for pid in pids), out

"""FSDP2 over real gloo ranks started by torchrun: 1 rank vs 2 ranks, global dynamic sampling, crash and
exact resume, resharding a checkpoint, and which checkpoint directories `--resume auto` may pick."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashdapo.trainer.state.checkpoint import CheckpointError, resume_candidates
from flashdapo.trainer.state.rundir import RunDirError, claim_run_dir
from tests.helpers.runs import ROOT, TINY, TRAINER_SCRIPTS, run_metrics, subprocess_env, torchrun

PAIRS = [("token-mean", "none"), ("seq-mean-token-mean", "token_truncate"), ("seq-mean-token-sum", "sequence_mask"),
         ("token-mean-per-micro-batch", "token_mask"), ("token-mean", "sequence_truncate")]


@pytest.mark.distributed
def test_two_ranks_and_micro_batches_update_equals_one_rank(tmp_path):
    """Every loss aggregation mode and rollout correction: 1 rank in one micro-batch per optimizer step, 1 rank
    in several, 2 ranks in several: the same losses, gradient norms and parameters."""
    runs = {"whole": (1, "100000"), "micro": (1, "30"), "two": (2, "48")}
    for name, (ranks, budget) in runs.items():
        (tmp_path / name).mkdir()
        torchrun(ranks, str(TRAINER_SCRIPTS / "update_equivalence.py"), str(tmp_path / name), budget)
    initial = torch.load(tmp_path / "whole" / "initial.pt")
    for mode, correction in PAIRS:
        tag = f"{mode}_{correction}"
        ref, micro, two = (json.loads((tmp_path / name / f"losses_{tag}.json").read_text()) for name in runs)
        assert len(ref["pg_loss"]) == 8  # 4 mini-batches x 2 epochs: 8 optimizer steps
        assert ref["clipfrac"] > 0  # later mini-batches really are off-policy and clipped
        assert ref["micro_batches"] == [1] * 8 and min(micro["micro_batches"]) >= 3, tag
        if correction != "none":  # the correction really weighs or masks tokens
            assert ref["rollout_corr/weight_mean"] != 1 or ref["rollout_corr/masked_fraction"] > 0, tag
        for other in (micro, two):
            _assert_same_update(ref, other, tag)
        pr, pm, pt = (torch.load(tmp_path / name / f"params_{tag}.pt") for name in runs)
        _assert_same_params(pr, pm, tag)
        _assert_same_params(pr, pt, tag)
        # The comparison means something: training moved every tensor.
        assert all((initial[n] - pr[n]).abs().max() > 1e-3 for n in pr if "norm" not in n), tag


def _assert_same_update(ref: dict, other: dict, tag: str) -> None:
    """Per optimizer step the same global losses and gradient norms, and the same token statistics."""
    for key in ("pg_loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(other[key]), torch.tensor(ref[key]), rtol=1e-5, atol=1e-7)
    # The token statistics, the clip regions and the splits by verdict among them, as the losses agree.
    assert other["stats"].keys() == ref["stats"].keys(), tag
    assert ref["stats"]["clip_upper"] + ref["stats"]["clip_lower"] > 0 and "entropy_wrong" in ref["stats"], tag
    for key, value in ref["stats"].items():
        assert other["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (tag, key)


def _assert_same_params(ref: dict, other: dict, tag: str) -> None:
    assert ref.keys() == other.keys()
    for name in ref:  # relative to each tensor's norm
        assert (other[name] - ref[name]).norm() <= 1e-5 * ref[name].norm(), (tag, name)


@pytest.mark.distributed
def test_mini_batches_of_fewer_groups_than_slots_update_as_one_rank(tmp_path):
    """One group per mini-batch on 2 ranks: its 4 responses are dealt 2 and 2, as the launch check allows
    (mini_batch x rollout.n >= data-parallel slots): the same update as 1 rank, every mode and correction."""
    for name, ranks in (("one", 1), ("two", 2)):
        (tmp_path / name).mkdir()
        torchrun(ranks, str(TRAINER_SCRIPTS / "update_equivalence.py"), str(tmp_path / name), "48", "1")
    for mode, correction in PAIRS:
        tag = f"{mode}_{correction}"
        ref, two = (json.loads((tmp_path / name / f"losses_{tag}.json").read_text()) for name in ("one", "two"))
        assert len(ref["pg_loss"]) == 16  # 8 mini-batches of one group x 2 epochs
        _assert_same_update(ref, two, tag)
        _assert_same_params(*(torch.load(tmp_path / name / f"params_{tag}.pt") for name in ("one", "two")), tag)


@pytest.mark.distributed
def test_global_dynamic_sampling_keeps_exactly_train_batch_groups(tmp_path):
    torchrun(2, str(TRAINER_SCRIPTS / "dynamic_sampling.py"), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["rounds"] == ranks[1]["rounds"] == 2
    assert ranks[0]["informative"] == ranks[1]["informative"] == 4
    # Every informative group came from rank 0's shards. Kept in order [0, 1, 4, 5]: global mini-batches
    # [0, 1] and [4, 5], every response of each dealt to exactly one rank; the responses are all as long,
    # so the token-balanced dealing gives each rank half of each mini-batch's 8.
    for k, groups in enumerate(([0, 1], [4, 5])):
        dealt = sorted(tuple(pair) for r in ranks for pair in r["kept"][k])
        assert dealt == [(p, m) for p in groups for m in range(4)]
        assert len(ranks[0]["kept"][k]) == len(ranks[1]["kept"][k]) == 4


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_mid_step_then_resume_auto_reproduces_the_uninterrupted_run(tmp_path):
    steps = ["--trainer.total-steps", "4", "--checkpoint.save-every", "2"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    torchrun(1, "-m", "flashdapo", "train", *TINY, *steps, "--logging.run-dir", str(straight))
    # SIGKILL inside step 3, after the checkpoint of step 2 was written.
    proc = subprocess.run([sys.executable, str(TRAINER_SCRIPTS / "kill_during_step.py"), "3", *TINY, *steps,
                           "--logging.run-dir", str(crashed)], capture_output=True, text=True, env=subprocess_env(),
                          cwd=ROOT, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert [r["step"] for r in run_metrics(crashed)] == [1, 2]
    assert not (crashed / "export").exists()
    torchrun(1, "-m", "flashdapo", "train", *TINY, *steps, "--logging.run-dir", str(crashed),
             "--checkpoint.resume", "auto")
    assert run_metrics(crashed) == run_metrics(straight)
    final_a = load_file(straight / "export" / "model.safetensors")
    final_b = load_file(crashed / "export" / "model.safetensors")
    assert final_a.keys() == final_b.keys()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoint_saved_by_two_ranks_resumes_on_one(tmp_path):
    run_dir = tmp_path / "run"
    common = [*TINY, "--checkpoint.save-every", "2", "--logging.run-dir", str(run_dir)]
    started = torchrun(2, "-m", "flashdapo", "train", *common, "--trainer.total-steps", "2")
    # The start line counts the full model and rank 0's shards of it (FSDP2 splits every tensor's rows in two).
    full, local = (int(n.replace(",", "")) for n in
                   re.search(r"([\d,]+) parameters \(([\d,]+) in this rank's shards\)", started.stdout).groups())
    assert full / 2 <= local < full
    saved = load_file(run_dir / "export" / "model.safetensors")
    # Resume at 1 rank with nothing left to train and no export: it is written from the resharded checkpoint.
    shutil.rmtree(run_dir / "export")
    torchrun(1, "-m", "flashdapo", "train", *common, "--trainer.total-steps", "2", "--checkpoint.resume", "auto")
    resharded = load_file(run_dir / "export" / "model.safetensors")
    assert all(torch.equal(saved[k], resharded[k]) for k in saved)
    # And training goes on from it (the optimizer state was resharded too).
    torchrun(1, "-m", "flashdapo", "train", *common, "--trainer.total-steps", "3", "--checkpoint.resume", "auto")
    rows = run_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["actor/pg_loss"])) for r in rows)


def _fake_checkpoint(root: Path, step: int, complete=True, metadata=True, state=True) -> Path:
    path = root / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    if complete:
        (path / "COMPLETE").write_text("{}")
    if metadata:
        (path / ".metadata").write_bytes(b"x")
    if state:
        (path / "trainer_state.pt").write_bytes(b"x")
    return path


def test_resume_auto_never_picks_partial_or_temporary_checkpoints(tmp_path):
    good = _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4, complete=False)  # crashed before the marker
    _fake_checkpoint(tmp_path, 6, metadata=False)  # corrupted: DCP metadata missing
    (tmp_path / "checkpoints" / "step_00000008.tmp").mkdir()  # an interrupted save
    assert resume_candidates("auto", tmp_path) == [good]
    assert resume_candidates("", tmp_path) == []
    assert resume_candidates("auto", tmp_path / "elsewhere") == []


def test_resume_explicit_bad_path_says_what_is_wrong(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        resume_candidates(str(tmp_path / "nope"), tmp_path)
    partial = _fake_checkpoint(tmp_path, 4, complete=False, metadata=False)
    with pytest.raises(CheckpointError, match=r"not a complete flashdapo checkpoint \(missing COMPLETE, .metadata\)"):
        resume_candidates(str(partial), tmp_path)


@pytest.mark.distributed
def test_hf_checkpoint_loads_into_two_shards_exactly(tmp_path):
    from transformers import AutoModelForCausalLM

    from flashdapo.config import ModelConfig
    from flashdapo.tasks.toy import build_toy_model

    model = build_toy_model(ModelConfig(), vocab_size=40, max_positions=64, seed=3)
    model.save_pretrained(tmp_path / "ckpt")
    torchrun(2, str(TRAINER_SCRIPTS / "load_checkpoint.py"), str(tmp_path / "ckpt"), str(tmp_path))
    loaded = torch.load(tmp_path / "loaded.pt")
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert loaded["params"].keys() == saved.keys()
    assert all(torch.equal(loaded["params"][k], saved[k]) for k in saved)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        expected = reference(input_ids=torch.arange(3, 15).reshape(2, 6)).logits
    torch.testing.assert_close(loaded["logits"], expected)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has stopped; whether it is reaped depends on who adopted it


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_workers_stop_when_the_torchrun_launcher_is_killed_and_their_lock_refuses_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "flashdapo",
           "train", *TINY, "--trainer.total-steps", "100000", "--checkpoint.save-every", "1",
           "--logging.run-dir", str(run_dir)]
    with (tmp_path / "out.txt").open("w") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(), cwd=ROOT)
    workers = []
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()[-3000:]
            time.sleep(0.5)
        workers = _children(launcher.pid)
        assert len(workers) == 2, (tmp_path / "out.txt").read_text()[-3000:]
        with pytest.raises(RunDirError, match="in use by a live run"):  # a resume meanwhile is refused
            claim_run_dir(run_dir, resume="auto", move_old_run=False)
        launcher.send_signal(signal.SIGKILL)  # the launcher alone: its workers live in process groups of their own
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers), \
            "workers kept running after their launcher died:\n" + (tmp_path / "out.txt").read_text()[-3000:]
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
    # The kernel releases their lock once every thread has exited (a dying process shows as a zombie first).
    deadline = time.monotonic() + 30
    while True:
        try:
            claim_run_dir(run_dir, resume="auto", move_old_run=False).release()
            break
        except RunDirError:
            assert time.monotonic() < deadline, "the dead workers' lock was not released"
            time.sleep(0.2)
    # One closing line per rank: the launcher watch (rundir.py) and the failure watch (failfast.py) both see the
    # launcher's loss; whichever ends the process says it, the other stays silent.
    out = (tmp_path / "out.txt").read_text()
    for rank in (0, 1):
        said = [line for line in out.splitlines() if line.startswith("flashdapo:") and "launcher" in line
                and (f"rank {rank}:" in line or f"rank {rank} stops" in line)]
        assert len(said) == 1, out[-3000:]

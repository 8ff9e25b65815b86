"""Tiny toy training runs: the toy preset shrunk to seconds (in this process, or on the command line under
torchrun), the environment of the processes a test starts, and the step records a run writes."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from flashdapo.config import merge, toy
from flashdapo.distributed.mesh import shutdown
from flashdapo.trainer import update
from flashdapo.trainer.loop import train_step
from flashdapo.trainer.setup import setup_run

ROOT = Path(__file__).resolve().parents[2]
TRAINER_SCRIPTS = ROOT / "tests" / "trainer" / "scripts"
"""The torchrun scripts of the trainer's tests (tests/trainer/scripts), run by path."""


def subprocess_env():
    """The environment of a process a test starts: this checkout importable, one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores
    return env


def torchrun(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone` of `nproc` ranks from the repository root; asserts a zero exit."""
    cmd = torchrun_cmd(nproc, *args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env(), cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    """The command line of `torchrun --standalone` of `nproc` ranks (run from the repository root)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def split_cmd(run_dir: Path, *args: str) -> list[str]:
    """`flashdapo train` of a tiny toy run in split placement under torchrun: 1 trainer + 1 rollout rank (gloo,
    torch engine), then `args`."""
    return torchrun_cmd(2, "-m", "flashdapo", "train", *TINY, "--rollout.placement", "split",
                        "--rollout.rollout-ranks", "1", *args, "--logging.run-dir", str(run_dir))


def launch(cmd: list[str], tag: Path | None = None, new_session: bool = False, **env: str) -> subprocess.Popen:
    """Start `cmd` from the repository root, stdout and stderr together in one text pipe; `tag` marks its ranks'
    environment (FLASHDAPO_TEST_TAG, for `rank_pid`); `new_session`: a process group of its own (for killpg, a
    terminal's Ctrl-C); `env`: more variables."""
    extra = {**({"FLASHDAPO_TEST_TAG": str(tag)} if tag is not None else {}), **env}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**subprocess_env(), **extra}, cwd=ROOT, start_new_session=new_session)


def rank_pid(tag: Path, rank: int) -> int | None:
    """The pid of the torchrun worker of RANK `rank` started by `launch(..., tag=tag)`, if it runs. A worker is
    the process torchrun's agent gave TORCHELASTIC_RUN_ID: the launcher shares the tag, and a RANK that an
    earlier test left in this pytest worker's environment, which it passes on."""
    for entry in Path("/proc").iterdir():
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        worker = any(var.startswith(b"TORCHELASTIC_RUN_ID=") for var in env)
        if worker and f"FLASHDAPO_TEST_TAG={tag}".encode() in env and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


def wait_rows(job: subprocess.Popen, run_dir: Path, rows: int, timeout: float = 300) -> None:
    """Wait until the run has logged `rows` steps in its metrics.jsonl (AssertionError if the job ends first or
    `timeout` seconds pass)."""
    metrics, deadline = Path(run_dir) / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline and job.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {rows} was not logged in time")


TINY = ["--model.toy.sft-steps", "20", "--model.toy.hidden-size", "32", "--model.toy.intermediate-size", "64",
        "--rollout.n", "4", "--rollout.val-n", "2", "--data.toy.num-val", "8",
        "--trainer.train-batch", "4", "--trainer.gen-batch", "4", "--trainer.mini-batch", "2",
        "--trainer.micro-batch-tokens", "64", "--trainer.val-every", "0", "--trainer.val-before-train", "False",
        "--algorithm.dynamic-sampling", "False", "--logging.plot", "False", "--logging.progress", "False"]
"""`flashdapo train` fields of a tiny toy run (the command-line twin of tiny_config)."""


def run_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl rows without their timings (`timing_s/`, `perf/`): what two runs of the same
    training share."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows]


def tiny_config(run_dir, **overrides):
    """The toy preset shrunk to seconds: a few warm-up steps, small batches."""
    base = toy()
    small = {
        "model": {"toy": {"sft_steps": 5, "hidden_size": 32, "intermediate_size": 64}},
        "data": {"toy": {"num_val": 6}},
        "rollout": {"n": 4, "val_n": 2},
        # An untrained model is always wrong: without dynamic sampling its groups still train, through the
        # overlong penalty's different scores for different lengths.
        "algorithm": {"dynamic_sampling": False},
        "trainer": {"total_steps": 2, "train_batch": 4, "gen_batch": 4, "mini_batch": 2, "val_every": 2,
                    "micro_batch_tokens": 64},
        "checkpoint": {"save_every": 0},
        "logging": {"run_dir": str(run_dir), "plot": True, "progress": False},
    }
    cfg = merge(base, small)
    return merge(cfg, overrides) if overrides else cfg


QUICK = {"trainer": {"total_steps": 2, "val_before_train": False, "val_every": 0},
         "checkpoint": {"save_every": 1, "keep_last": 3}, "logging": {"plot": False}}
"""tiny_config's fields for a run to resume: 2 steps, a checkpoint after each, no validation or plot."""


def quick_config(run_dir, **overrides):
    """tiny_config with QUICK: a 2-step run checkpointed after each step."""
    cfg = tiny_config(run_dir, **QUICK)
    return merge(cfg, overrides) if overrides else cfg


def resume_config(run_dir, **overrides):
    """quick_config resuming its run directory's newest checkpoint (`checkpoint.resume auto`)."""
    cfg = quick_config(run_dir, checkpoint={"resume": "auto"})
    return merge(cfg, overrides) if overrides else cfg


def first_step_weights(cfg, monkeypatch, force_recompute=False):
    """The metrics of step 1 of `cfg` and the policy's parameters after it (force_recompute: the old
    log-probs recomputed even where the update is on-policy)."""
    if force_recompute:
        monkeypatch.setattr(update, "on_policy", lambda _cfg: False)
    run = setup_run(cfg)
    try:
        metrics = train_step(run, 1)
        weights = [p.detach().clone() for p in run.policy.parameters()]
    finally:
        run.logger.close()
        shutdown()
        monkeypatch.undo()
    return metrics, weights


def train_two_steps_on(model: Path, tmp_path: Path) -> tuple[Path, list[dict]]:
    """`flashdapo train --model.path model` for 2 steps on 8 addition problems, the engine's sampling and two
    updates at the smallest batch (no checkpoint): (the run dir, its metrics rows). Asserts a zero exit."""
    from flashdapo.__main__ import main as cli

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a}+{a + 1}", "answer": str(2 * a + 1)}) + "\n" for a in range(8)))
    run = tmp_path / "run"
    assert cli(["train", "--model.path", str(model), "--data.train-files", str(data), "--data.max-prompt-length", "32",
                "--rollout.max-response-length", "8", "--rollout.n", "2", "--trainer.train-batch", "2",
                "--trainer.gen-batch", "2", "--trainer.mini-batch", "1", "--trainer.micro-batch-tokens", "64",
                "--trainer.total-steps", "2", "--trainer.val-every", "0", "--trainer.val-before-train", "False",
                "--algorithm.dynamic-sampling", "False", "--checkpoint.save-every", "0", "--logging.plot", "False",
                "--logging.progress", "False", "--logging.run-dir", str(run)]) == 0
    return run, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

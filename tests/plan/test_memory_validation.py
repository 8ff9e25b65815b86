"""The plan's memory model against what torch's FSDP2 memory tracker measures, at 1 and 2 gloo ranks: the
toy model through the trainer's update (real tensors), and Qwen2.5-0.5B's exact shape under FakeTensorMode
(tests/plan/scripts/measure_memory.py). Parameter, gradient and AdamW bytes per rank are predicted exactly;
the first step's peak within 25%."""

import json

import pytest

from flashdapo.config import toy
from flashdapo.plan.memory import TrainSetup, first_step_peak_bytes, state_bytes
from flashdapo.plan.model import build_meta_model, model_shape
from flashdapo.plan.shapes import ModelSource, builtin_shape
from tests.helpers.runs import ROOT, torchrun

SCRIPT = ROOT / "tests" / "plan" / "scripts" / "measure_memory.py"


def _shape(case: str):
    if case == "toy":  # the script's toy: the default toy shape with its task's 289-token vocabulary
        cfg = toy()
        source = ModelSource({}, "toy", toy=True)
    else:
        cfg, source = toy(), ModelSource(builtin_shape("Qwen2.5-0.5B"), "Qwen2.5-0.5B")
    return model_shape(build_meta_model(source, cfg), case)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [1, 2])
def test_predicted_memory_matches_the_measured(ranks, tmp_path):
    torchrun(ranks, str(SCRIPT), str(tmp_path), "toy", "qwen0.5b")
    for case in ("toy", "qwen0.5b"):
        shape = _shape(case)
        # CPU: fp32 compute (no mixed precision), gradient checkpointing, the CPU's LM-head path (the fused
        # sweep through update_actor; the plain HF forward's materialized logits for the 0.5B run).
        setup = TrainSetup(world=ranks, compute_bytes=4, offload=False, checkpointing=True,
                           reshard_after_forward=True, sequence_parallel=1, flash_attention=False,
                           lm_head="fused" if case == "toy" else "naive", device="cpu")
        for rank in range(ranks):
            measured = json.loads((tmp_path / f"{case}_rank{rank}.json").read_text())
            state = state_bytes(shape, ranks, rank)
            assert (state.params, state.grads, state.moments, state.steps) == \
                (measured["params"], measured["grads"], measured["moments"], measured["steps"]), (case, rank)
            predicted = first_step_peak_bytes(shape, setup, measured["tokens"], rank)
            peak = measured["peak"]["Total"]
            assert abs(predicted - peak) <= 0.25 * peak, (case, rank, predicted, peak, measured["peak"])

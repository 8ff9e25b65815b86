"""Non-finite values never reach the weights: a NaN/inf loss or gradient norm skips that optimizer step on
every rank (`actor/skipped_steps`), the LR schedule moves only with steps taken, trainer.max_skipped_steps
skips in a row stop the run naming the step, and a NaN reward is an error naming its prompt."""

import math

import pytest
import torch

from flashdapo.distributed.mesh import shutdown
from flashdapo.reward import RewardError, Verdict
from flashdapo.trainer import update as update_module
from flashdapo.trainer.loop import train_step
from flashdapo.trainer.setup import setup_run
from flashdapo.trainer.update import NonFiniteError
from tests.helpers.runs import tiny_config


def _finite(run) -> bool:
    return all(bool(torch.isfinite(t).all()) for _, t in run.weights.export())


@pytest.mark.filterwarnings("ignore::UserWarning")  # the log-prob check reports the NaN as well
def test_a_tiny_temperature_stops_the_run_with_its_weights_finite(tmp_path):
    # logits / 1e-40 overflow: every loss is NaN. Two optimizer steps per training step, both skipped.
    cfg = tiny_config(tmp_path / "run", rollout={"temperature": 1e-40}, trainer={"max_skipped_steps": 2})
    run = setup_run(cfg)
    try:
        before = {n: t.clone() for n, t in run.weights.export()}
        with pytest.raises(NonFiniteError, match=r"step 1: 2 optimizer steps in a row had a non-finite loss or "
                                                 r"gradient norm .* Newest good checkpoint: none"):
            train_step(run, 1)
        assert _finite(run) and all(torch.equal(before[n], t) for n, t in run.weights.export())
        assert run.scheduler.last_epoch == 0 and run.weights.version == 0
    finally:
        shutdown()


def test_an_injected_nan_skips_that_step_only_then_a_nan_reward_stops(tmp_path, monkeypatch):
    run = setup_run(tiny_config(tmp_path / "run"))
    real_loss, calls = update_module.token_loss, {"n": 0}

    def nan_on_first_call(*args, **kwargs):  # the first micro-batch of the first mini-batch
        loss, stats = real_loss(*args, **kwargs)
        calls["n"] += 1
        return (loss * math.nan if calls["n"] == 1 else loss), stats

    monkeypatch.setattr(update_module, "token_loss", nan_on_first_call)
    try:
        before = {n: t.clone() for n, t in run.weights.export()}
        metrics = train_step(run, 1)
        assert metrics["actor/skipped_steps"] == 1 and math.isfinite(metrics["actor/grad_norm"])
        assert _finite(run) and any(not torch.equal(before[n], t) for n, t in run.weights.export())
        assert run.scheduler.last_epoch == 1 and run.skipped_in_a_row == 0  # the second step was taken
        run.verifier = lambda text, truth: Verdict(math.nan, False, "")
        with pytest.raises(RewardError, match=r"reward nan for prompt toy:train:\d+ \(response ending"):
            train_step(run, 2)
    finally:
        shutdown()

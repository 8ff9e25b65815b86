"""The update through the fused sweep (kernels.fused_token_loss, the CPU default) equals the update through
token_logprobs + token_loss: same loss, statistics, gradient norm and weights after a step."""

import pytest
import torch

from flashdapo.models import policy
from flashdapo.models.policy import PolicyModel
from tests.helpers.runs import first_step_weights, tiny_config


def test_fused_update_equals_generic(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path / "fused", trainer={"mini_batch": 2})  # several optimizer steps
    calls = []
    real = policy.fused_token_loss
    monkeypatch.setattr(policy, "fused_token_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused, w_fused = first_step_weights(cfg, monkeypatch)
    assert calls, "the CPU update should take the fused sweep"
    monkeypatch.setattr(PolicyModel, "fused_loss", lambda self, device: False)
    generic, w_generic = first_step_weights(tiny_config(tmp_path / "generic", trainer={"mini_batch": 2}),
                                             monkeypatch)
    assert fused["actor/grad_norm"] > 0
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
        if key in generic:
            assert fused[key] == pytest.approx(generic[key], rel=1e-4, abs=1e-7), key
    for a, b in zip(w_fused, w_generic):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

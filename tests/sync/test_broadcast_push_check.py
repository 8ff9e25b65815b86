"""Split placement's rollout-side push check (flashdapo/sync/broadcast.py `check_loaded`) takes the
co-located check's tolerance (observe/logprob_check.py): fp32's 1e-3 when the pushed dtype (the one the rollout
side computes in) is fp32, else the bf16 tolerance `PushCheck.calibrate` measures once, at the first bf16
version. Fakes for the policy forwards; one process, no group."""

import pytest
import torch
from torch import nn

from flashdapo.sync.broadcast import StagedVersion, _checksum, check_loaded
from flashdapo.sync.check import Calibration, PushMismatchError


class FakeCheck:
    """A PushCheck whose forwards are given: the rollout side's probe log-probs, its calibration's errors."""

    def __init__(self, mine: torch.Tensor, own_error: tuple[float, float] = (1e-3, 4e-3)):
        self.probe, self.mine, self.own_error = [[1, 2, 3]], mine, own_error
        self.calibration: Calibration | None = None
        self.calibrated: list[torch.dtype] = []

    def trainer_logprobs(self, _sequences):
        return [self.mine]

    def calibrate(self, dtype, trainer, engine):
        self.calibrated.append(dtype)
        return Calibration(dtype, *self.own_error)


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.hf = nn.Linear(2, 2, bias=False)


def _staged(policy: Policy, dtype: torch.dtype, probe: torch.Tensor) -> StagedVersion:
    weight = policy.hf.weight.detach().to(dtype)
    return StagedVersion({"weight": weight}, probe, {"weight": _checksum(weight).item()}, dtype)


def test_bf16_compute_takes_the_calibrated_bf16_tolerance_fp32_the_fixed_one():
    policy, probe = Policy(), -torch.rand(20, generator=torch.Generator().manual_seed(0))
    bf16_noise = probe + 3e-3 * torch.linspace(-1, 1, 20)  # bf16 arithmetic's spread: beyond fp32's 1e-3
    check = FakeCheck(bf16_noise)
    staged = _staged(policy, torch.bfloat16, probe)
    assert check_loaded(policy, staged, check, 1) == pytest.approx(3e-3, rel=1e-3)
    assert check_loaded(policy, staged, check, 2) == pytest.approx(3e-3, rel=1e-3)
    assert check.calibrated == [torch.bfloat16]  # measured once
    # Beyond the calibrated tolerance (2 x 1e-3 + 5e-4 mean, 3 x 4e-3 + 5e-3 max): refused in one line naming the tolerance.
    check.mine = probe + 0.05
    with pytest.raises(PushMismatchError) as err:
        check_loaded(policy, staged, check, 3)
    message = str(err.value)
    assert "\n" not in message and "beyond 0.0025 mean / 0.017 max" in message and "bfloat16 weights" in message
    assert "tensors that differ: none (the forward itself differs)" in message
    # fp32 compute: the fixed 1e-3, never calibrated.
    fp32 = FakeCheck(bf16_noise)
    with pytest.raises(PushMismatchError, match=r"beyond 0\.001 max for float32 weights"):
        check_loaded(policy, _staged(policy, torch.float32, probe), fp32, 1)
    assert fp32.calibrated == []
    assert check_loaded(policy, _staged(policy, torch.float32, probe), FakeCheck(probe + 5e-4), 1) == \
        pytest.approx(5e-4, rel=1e-3)

"""The cost model with a final-logit softcap: the extra elementwise work (tanh and sech^2 per logit) is
counted as SFU ops, bytes and memory of the Triton designs unchanged, the model without a cap exactly as
before, and the choice of design unchanged at the shapes the trainer runs."""

from __future__ import annotations

from functools import partial

import pytest

from flashdapo.kernels.cost import SFU_PER_LOGIT, SOFTCAP_SFU_PER_LOGIT, fused, generic, naive, torch_impl
from flashdapo.kernels.gpus import GPUS
from flashdapo.kernels.lm_head_choice import lm_head_design

SHAPES = [(16384, 896, 151936), (16384, 3584, 152064), (22528, 5120, 152064), (16384, 3584, 262144)]


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_softcap_counts_sfu_work_bytes_unchanged(gpu):
    rates = GPUS[gpu].kernel_rates()
    for n, h, v in SHAPES:
        for design in (partial(generic, n, h, v, rates=rates), partial(generic, n, h, v, 0.5, rates),
                       partial(fused, n, h, v, rates)):
            off, on = design(), design(softcap=True)
            assert off.sfu_bound_ms == 0.0, "without a cap every pass streams: the time is the bytes' alone"
            assert on.exposed_gb == off.exposed_gb and on.peak_extra_gb == off.peak_extra_gb
            assert on.gemm_tflop == off.gemm_tflop
            ratio = (SFU_PER_LOGIT + SOFTCAP_SFU_PER_LOGIT) / SFU_PER_LOGIT
            assert on.sfu_gop == pytest.approx(ratio * off.sfu_gop)
            assert on.ms >= off.ms and on.ms <= 1.05 * off.ms  # the passes are a small share of the step
        assert naive(n, h, v, rates, softcap=True).exposed_gb > naive(n, h, v, rates).exposed_gb
        assert torch_impl(n, h, v, rates, softcap=True).exposed_gb > torch_impl(n, h, v, rates).exposed_gb


def test_softcap_sfu_bound_where_the_sfu_is_slow():
    """4 SFU ops a logit against the stats pass's 4 bytes: within an H200's SFU rate, beyond an H20's."""
    n, h, v = SHAPES[1]
    assert generic(n, h, v, rates=GPUS["h200"].kernel_rates(), softcap=True).sfu_bound_ms == 0.0
    assert generic(n, h, v, rates=GPUS["h20"].kernel_rates(), softcap=True).sfu_bound_ms > 0.0


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_design_choice_with_softcap(gpu):
    for n, h, v in SHAPES:
        assert lm_head_design(GPUS[gpu], n, h, v, softcap=True) == lm_head_design(GPUS[gpu], n, h, v)
    assert lm_head_design(None, 16384, 3584, 262144, softcap=True) == "generic"

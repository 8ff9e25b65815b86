"""The update's LM-head design per GPU follows the kernel cost model (trainer/lm_head_choice.py)."""

import dataclasses

import pytest
import torch

from flashdapo.kernels.cost import fused, generic
from flashdapo.kernels.gpus import GPUS, gpu_of_device
from flashdapo.kernels.lm_head_choice import MAX_EXTRA_FRACTION, MIN_SAVING, lm_head_design, use_fused_loss

SHAPES = {"7B": (16384, 3584, 152064), "32B": (22528, 5120, 152064)}


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_known_gpu_gets_the_fused_sweep_where_the_model_says_it_saves_time_within_its_memory(gpu, shape):
    n, h, v = SHAPES[shape]
    spec = GPUS[gpu]
    g, f = generic(n, h, v, rates=spec.kernel_rates()), fused(n, h, v, rates=spec.kernel_rates())
    saves = f.ms <= (1 - MIN_SAVING) * g.ms
    fits = (f.peak_extra_gb - g.peak_extra_gb) * 1e9 <= MAX_EXTRA_FRACTION * spec.memory_bytes
    assert saves and fits  # the model's verdict at these shapes: 6NHV beats 8NHV on every GPU it knows
    assert lm_head_design(spec, n, h, v) == "fused"


def test_the_saving_is_largest_where_compute_is_scarcest():
    n, h, v = SHAPES["32B"]
    saved = {k: generic(n, h, v, rates=g.kernel_rates()).ms - fused(n, h, v, rates=g.kernel_rates()).ms
             for k, g in GPUS.items()}
    assert max(saved, key=saved.get) == "h20"  # the lowest bf16 rate: the most milliseconds saved per micro-batch


def test_an_unknown_or_small_gpu_keeps_the_generic_path():
    n, h, v = SHAPES["32B"]
    assert lm_head_design(None, n, h, v) == "generic"
    small = dataclasses.replace(GPUS["a100"], memory_gib=24)  # ~3.4 GB more is over 5% of 24 GiB
    assert lm_head_design(small, n, h, v) == "generic"


def test_device_names_map_to_known_gpus():
    assert gpu_of_device("NVIDIA H20").key == "h20"
    assert gpu_of_device("NVIDIA H200").key == "h200"
    assert gpu_of_device("NVIDIA H100 80GB HBM3").key == "h100"
    assert gpu_of_device("NVIDIA A100-SXM4-80GB").key == "a100"
    assert gpu_of_device("NVIDIA L4") is None


def test_a_cpu_keeps_the_fused_sweep_and_naive_has_none():
    cpu = torch.device("cpu")
    assert use_fused_loss("auto", cpu, 4096, 64, 289)
    assert not use_fused_loss("naive", cpu, 4096, 64, 289)

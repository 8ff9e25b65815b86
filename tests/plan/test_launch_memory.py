"""The launch's own memory check refuses what `flashdapo plan` refuses (Qwen2.5-7B on one GPU without
offload), in one line naming trainer.fsdp_cpu_offload, and checks nothing where it cannot know."""

from __future__ import annotations

import json

import pytest

from flashdapo.config import merge, preset
from flashdapo.plan.fit import PlanError
from flashdapo.plan.launch import check_launch_memory
from flashdapo.plan.shapes import builtin_shape


@pytest.fixture
def qwen7b(tmp_path):
    """A model directory holding only Qwen2.5-7B's config.json (the check reads no weights)."""
    (tmp_path / "config.json").write_text(json.dumps(builtin_shape("qwen2.5-7b")))
    return str(tmp_path)


def _cfg(model_dir: str, **trainer):
    return merge(preset("qwen2.5-7b-math"), {"model": {"path": model_dir}, "trainer": trainer})


def test_seven_b_on_one_h200_without_offload_is_refused_naming_the_field(qwen7b):
    with pytest.raises(PlanError, match="trainer.fsdp_cpu_offload") as refused:
        check_launch_memory(_cfg(qwen7b), 1, "NVIDIA H200")
    assert "\n" not in str(refused.value)


def test_the_same_launch_on_a_full_node_is_checked_and_passes(qwen7b):
    assert check_launch_memory(_cfg(qwen7b), 8, "NVIDIA H200") is None


def test_nothing_is_checked_without_a_gpu_a_model_or_a_known_gpu(qwen7b):
    assert check_launch_memory(_cfg(qwen7b), 1, None) == "no GPU"
    assert check_launch_memory(preset("toy"), 1, "NVIDIA H200") == "the built-in toy model"
    assert "not in the GPU table" in check_launch_memory(_cfg(qwen7b), 1, "Some Future GPU")


def test_the_torch_engine_launch_is_refused_for_adamw_state_and_passes_with_offload(qwen7b):
    """No vLLM: the training phase alone (parameters, gradients, two moments, AdamW's foreach temporary)."""
    torch_engine = merge(_cfg(qwen7b), {"rollout": {"engine": "torch"}})
    with pytest.raises(PlanError, match=r"training needs .*trainer.fsdp_cpu_offload=true"):
        check_launch_memory(torch_engine, 1, "NVIDIA H200")
    assert check_launch_memory(merge(torch_engine, {"trainer": {"fsdp_cpu_offload": True}}), 1, "NVIDIA H200") is None

"""`flashdapo plan` under LoRA: the adapters counted exactly from the model's shapes (and as peft puts them on),
the frozen base in bf16 with no gradients or AdamW moments, the transients and the step time without the base's
weight gradients, the push of the adapters alone, and the qwen2.5-32b-dapo-lora preset on its documented
cluster (docs/plan.md, "LoRA")."""

from __future__ import annotations

import dataclasses
import math

import pytest

from flashdapo.__main__ import main
from flashdapo.config import PRESET_CLUSTERS, ConfigError, merge, preset, toy
from flashdapo.kernels.cost import fused, generic
from flashdapo.kernels.gpus import gpu_named
from flashdapo.models.lora import add_adapters
from flashdapo.plan.checks import launch_checks
from flashdapo.plan.fit import GIB, PlanError, memory_plan
from flashdapo.plan.launch import check_launch_memory
from flashdapo.plan.memory import (
    TrainSetup,
    block_saved,
    lm_head_cost,
    staged_weights_bytes,
    state_bytes,
    transients,
)
from flashdapo.plan.model import build_meta_model, model_shape
from flashdapo.plan.shapes import ModelSource, builtin_shape, model_source
from flashdapo.plan.step_time import Workload, push_bytes, step_time

# A small Qwen2: hidden 64, key/value width 2 heads x 16 = 32, MLP 128, 2 layers, vocabulary 256, untied head;
# every dim 0 is even, so at 2 ranks every FSDP2 shard is exactly half its tensor.
SMALL = {**builtin_shape("Qwen2.5-7B"), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512}
H, K, MLP, V, L, R = 64, 32, 128, 256, 2, 4
# By hand. Base per layer: q 64x64 + 64 bias, k and v 32x64 + 32, o 64x64, gate and up 128x64, down 64x128, two
# norms of 64: 4160 + 2 x 2080 + 4096 + 3 x 8192 + 128 = 37120; embedding and head 256 x 64 each, final norm 64.
BASE = L * 37120 + 2 * V * H + H  # 107,072
# Adapters: r (in + out) per adapted linear: q 4 x 128, k and v 4 x 96, o 4 x 128, gate and up 4 x 192, down
# 4 x 192 = 4096 a layer.
ADAPTERS = L * R * ((H + H) + 2 * (H + K) + (H + H) + 3 * (H + MLP))  # 8,192


def _lora(rank: int = R, **fields):
    """LoRA on the toy preset; the adapters alone unless `train_norms` says otherwise (the by-hand sums below
    count adapters; test_trained_norms_... adds the norms)."""
    return merge(toy(), {"lora": {"rank": rank, "train_norms": "none", **fields}})


def _small(cfg=None):
    cfg = cfg or _lora()
    model = build_meta_model(ModelSource(SMALL, "small"), cfg)
    return model, model_shape(model, "small", cfg.lora)


def _setup(world: int, **changes) -> TrainSetup:
    base = TrainSetup(world=world, compute_bytes=2, offload=False, checkpointing=True, reshard_after_forward=True,
                      sequence_parallel=1, flash_attention=True, lm_head="fused", device="cuda")
    return dataclasses.replace(base, **changes)


def test_adapters_are_counted_exactly_from_the_shapes_and_match_peft():
    model, shape = _small()
    assert (BASE, ADAPTERS) == (107_072, 8_192)
    assert shape.base_parameters == BASE and shape.adapter_parameters == ADAPTERS
    assert shape.parameters == BASE + ADAPTERS and shape.trainable_parameters == ADAPTERS and shape.lora_rank == R
    assert sum(t.adapter for t in shape.tensors) == L * 7 * 2
    # The trainer's own path: peft's adapters on the same model, every other parameter frozen.
    add_adapters(model, _lora().lora, seed=0)
    trainable = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {t.name: t.shape for t in shape.tensors if t.adapter}
    assert sum(p.numel() for p in model.parameters()) == shape.parameters
    # Without LoRA the shape is the base alone, and everything trains.
    _, full = _small(toy())
    assert full.parameters == BASE and full.trainable_parameters == BASE and not full.lora


def test_trained_norms_count_as_trainable_as_the_trainer_trains_them_and_are_pushed():
    cfg = _lora(train_norms="all")
    model, shape = _small(cfg)
    norms = L * 2 * H + H  # input and post-attention norms per block, the final norm
    assert shape.trainable_parameters == ADAPTERS + norms and shape.adapter_parameters == ADAPTERS
    add_adapters(model, cfg.lora, seed=0)
    trainable = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {t.name: t.shape for t in shape.tensors if shape.trainable(t)}
    assert push_bytes(shape, cfg) == 4 * (ADAPTERS + norms)
    state = state_bytes(shape, 2, 0, frozen_bytes=2)
    assert state.frozen == 2 * (BASE - norms) // 2 and state.grads == 4 * (ADAPTERS + norms) // 2
    _, final = _small(_lora(train_norms="final"))
    assert final.trainable_parameters == ADAPTERS + H


def test_target_modules_narrow_the_adapters_and_a_wrong_name_is_refused_as_the_launch_refuses_it():
    _, shape = _small(_lora(target_modules=["q_proj", "v_proj"]))
    assert shape.adapter_parameters == L * R * ((H + H) + (H + K))
    with pytest.raises(ConfigError, match="lora.target_modules: qkv_proj is no linear layer"):
        _small(_lora(target_modules=["qkv_proj"]))


def test_lora_state_is_the_bf16_base_and_the_fp32_adapters_with_their_gradients_and_moments():
    _, shape = _small()
    state = state_bytes(shape, 2, 0, frozen_bytes=2)
    # Half of every tensor a rank: the base at 2 bytes, the adapters at 4 + 4 + 8, a step per adapter tensor.
    assert state.frozen == 2 * BASE // 2 == 107_072
    assert state.params == 107_072 + 4 * ADAPTERS // 2 == 123_456
    assert (state.grads, state.moments, state.steps) == (16_384, 32_768, 4 * 28)
    _, full = _small(toy())
    full_state = state_bytes(full, 2, 0)
    assert (full_state.params, full_state.grads, full_state.moments, full_state.frozen) == \
        (4 * BASE // 2, 4 * BASE // 2, 8 * BASE // 2, 0)
    assert state.total < full_state.total / 2


def test_lora_transients_by_hand():
    _, shape = _small()
    _, full = _small(toy())
    tokens, b = 1000, 2
    lora, whole = transients(shape, _setup(2), tokens), transients(full, _setup(2), tokens)
    # Each adapted linear saves its A output [T, r]; the adapter path adds an input gradient of the widest
    # adapted input (down_proj's 128).
    assert block_saved(shape, tokens, b, True) - block_saved(full, tokens, b, True) == tokens * b * 7 * R
    assert lora.recompute - whole.recompute == tokens * b * (7 * R + MLP)
    # lora.dropout: the dropped inputs (b) and their masks (1 byte) of every adapted linear as well.
    dropped = block_saved(shape, tokens, b, True, lora_dropout=0.1) - block_saved(shape, tokens, b, True)
    assert dropped == tokens * (b + 1) * (6 * H + MLP)  # q, k, v, o, gate, up read H; down reads MLP
    # Reduction: a block's adapter gradients only (b, and the fp32 reduce-scatter input), no LM-head dW.
    assert lora.layer_reduce == (b + 4) * ADAPTERS // L
    assert whole.layer_reduce == (b + 4) * 37120 + b * V * H
    # End of backward: the frozen root's gathered parameters alone; the step: the adapters' shards.
    root = 2 * V * H + H
    assert lora.end_of_backward == b * root
    assert lora.optimizer_step == 4 * ADAPTERS // 2
    # Gathered: the same blocks, their adapters included (cast to bf16).
    assert lora.gathered - whole.gathered == b * 2 * ADAPTERS // L
    # Offload: the frozen base is copied in bf16 with no cast, the adapters in fp32 and cast.
    off = transients(shape, _setup(2, offload=True), tokens)
    blocks = 2 * (37120 + ADAPTERS // L) + root
    assert off.gathered - lora.gathered == (b * (blocks - 2 * ADAPTERS // L) + 6 * 2 * ADAPTERS // L) // 2


@pytest.mark.parametrize("n", [512, 22528])
def test_a_frozen_lm_head_has_no_weight_gradient_in_either_kernel(n):
    h, v, b = 5120, 152064, 2
    f_full, f_frozen = fused(n, h, v), lm_head_cost("fused", n, h, v, b, "cuda", weight_grad=False)
    assert f_frozen.gemm_tflop == pytest.approx(f_full.gemm_tflop * 4 / 6)
    assert f_full.exposed_gb - f_frozen.exposed_gb == pytest.approx((8 + b) * v * h / 1e9)
    if n > 10000:  # the sweep's peak (at the preset's 22528 rows): less the fp32 dW accumulator
        assert f_full.peak_extra_gb - f_frozen.peak_extra_gb == pytest.approx(4 * v * h / 1e9)
    else:  # the full head peaks at the sweep's end (the accumulator and its cast); the frozen in its sweep
        assert f_full.peak_extra_gb * 1e9 == pytest.approx((4 + b) * v * h + b * n * h + 16 * n)
        assert f_frozen.peak_extra_gb <= f_full.peak_extra_gb - 4 * v * h / 1e9
    assert f_frozen.peak_extra_gb - f_frozen.workspace_gb == pytest.approx(b * n * h / 1e9)  # dh only
    g_full, g_frozen = generic(n, h, v), lm_head_cost("generic", n, h, v, b, "cuda", weight_grad=False)
    assert g_frozen.gemm_tflop == pytest.approx(g_full.gemm_tflop * 6 / 8)
    assert g_full.exposed_gb == pytest.approx(g_frozen.exposed_gb)
    assert g_full.peak_extra_gb - g_frozen.peak_extra_gb == pytest.approx(b * v * h / 1e9)  # dW
    assert lm_head_cost("fused", n, h, v, b, "cuda") == f_full  # the trained head: the kernel model's own


def test_the_update_skips_the_base_weight_gradients_and_the_push_is_the_adapters():
    cfg = merge(preset("qwen2.5-32b-dapo-lora"), {"lora": {"rank": R, "train_norms": "none"}})
    _, shape = _small(cfg)
    _, full = _small(merge(cfg, {"lora": {"rank": 0}}))
    gpu, work = gpu_named("h100"), Workload(mean_response=4096, mean_prompt=256, mfu=0.4)
    lora_time, full_time = (step_time(s, cfg, 8, gpu, None, "fused", work) for s in (shape, full))
    # FLOPs per token: 8 a trained parameter (checkpointing), 6 a frozen one; the embedding and head are not
    # dense parameters; attention is the same in both.
    dense = BASE - 2 * V * H
    attention = full_time.update - 8 * dense * _tokens(cfg) / _flops(gpu, work)
    assert lora_time.update == pytest.approx((6 * dense + 8 * ADAPTERS) * _tokens(cfg) / _flops(gpu, work)
                                             + attention)
    # The forward runs through the adapters too.
    assert lora_time.old_logprobs > full_time.old_logprobs
    assert push_bytes(shape, cfg) == 4 * ADAPTERS and push_bytes(full, cfg) == 2 * BASE
    # Split placement stages k + 1 versions of what is pushed, in the compute dtype: the adapters alone.
    assert staged_weights_bytes(shape, 1, 2) == 2 * 2 * ADAPTERS and staged_weights_bytes(full, 1, 2) == 2 * 2 * BASE


def _tokens(cfg) -> float:
    return cfg.trainer.train_batch * cfg.rollout.n / 8 * (256 + 4096)


def _flops(gpu, work) -> float:
    return gpu.bf16_tflops * 1e12 * work.mfu


# ---------------------------------------------------------------------------------------------------
# Qwen2.5-32B: full vs LoRA, and the preset's cluster


@pytest.fixture(scope="module")
def qwen32b():
    cfg = preset("qwen2.5-32b-dapo-lora")
    source = model_source(cfg)
    model = build_meta_model(source, cfg)
    return source, model, model_shape(model, "Qwen2.5-32B", cfg.lora), model_shape(model, "Qwen2.5-32B")


def test_the_32b_adapters_and_lora_memory_below_full(qwen32b):
    _, _, lora, full = qwen32b
    # rank 32 on q, k, v, o (5120 + 5120, 5120 + 1024 twice, 5120 + 5120) and gate, up, down (5120 + 27648) in 64
    # layers
    assert lora.adapter_parameters == 64 * 32 * (2 * 10240 + 2 * 6144 + 3 * 32768) == 268_435_456
    cfg = preset("qwen2.5-32b-dapo-lora")
    full_cfg = merge(cfg, {"lora": {"rank": 0}})
    for gpu in ("h100", "h20"):
        adapted = memory_plan(cfg, 8, lora, gpu_named(gpu))
        whole = memory_plan(full_cfg, 8, full, gpu_named(gpu), check=False)
        assert adapted.state.total < whole.state.total / 7
        assert adapted.train_peak < whole.train_peak and adapted.resident < whole.resident
        assert adapted.transients.lm_head < whole.transients.lm_head
        assert adapted.transients.layer_reduce < whole.transients.layer_reduce / 50


def test_the_lora_preset_fits_its_documented_node_and_the_full_recipe_does_not_without_offload(qwen32b):
    source, model, lora, full = qwen32b
    cfg = preset("qwen2.5-32b-dapo-lora")
    assert (cfg.lora.rank, cfg.trainer.fsdp_cpu_offload, cfg.trainer.sequence_parallel) == (32, False, 1)
    full_recipe = preset("qwen2.5-32b-dapo")
    for name in ("max_response_length", "n", "tensor_parallel_size", "gpu_memory_utilization"):
        assert getattr(cfg.rollout, name) == getattr(full_recipe.rollout, name)
    assert (cfg.data.max_prompt_length, cfg.trainer.train_batch, cfg.trainer.gen_batch, cfg.trainer.mini_batch) == \
        (full_recipe.data.max_prompt_length, 512, 1536, 32)
    cluster = PRESET_CLUSTERS["qwen2.5-32b-dapo-lora"][0]
    assert (cluster.nodes, cluster.gpus_per_node) == (1, 8)  # the smallest whole node: 8 GPUs
    no_offload = merge(full_recipe, {"trainer": {"fsdp_cpu_offload": False, "sequence_parallel": 1}})
    for gpu in ("h100", "h20"):
        launch_checks(cfg, cluster.world_size, source, lora, [])
        plan = memory_plan(cfg, cluster.world_size, lora, gpu_named(gpu))
        assert plan.generation_total < plan.gpu.memory_bytes and plan.training_total < plan.gpu.memory_bytes
        with pytest.raises(PlanError, match="generation needs"):
            memory_plan(no_offload, cluster.world_size, full, gpu_named(gpu))
        # Below a node: 4 GPUs (one vLLM engine of 4) still fit; 2 do not (vLLM's 4-way tensor parallelism
        # needs 4 ranks, and at 2-way its memory fraction is not free beside the trainer's half of the base).
        memory_plan(cfg, 4, lora, gpu_named(gpu))
        with pytest.raises(ConfigError, match="tensor_parallel_size"):
            launch_checks(cfg, 2, source, lora, [])
        with pytest.raises(PlanError, match="vLLM asks"):
            memory_plan(merge(cfg, {"rollout": {"tensor_parallel_size": 2}}), 2, lora, gpu_named(gpu))


def test_the_launch_check_models_the_adapters(tmp_path):
    """The launch's own memory check (plan/launch.py) plans the adapters too: Qwen2.5-7B on one H200 without
    offload is refused when the whole model trains, and passes with LoRA."""
    (tmp_path / "config.json").write_text(__import__("json").dumps(builtin_shape("Qwen2.5-7B")))
    cfg = merge(preset("qwen2.5-7b-math"), {"model": {"path": str(tmp_path)}})
    with pytest.raises(PlanError, match="trainer.fsdp_cpu_offload"):
        check_launch_memory(cfg, 1, "NVIDIA H200")
    assert check_launch_memory(merge(cfg, {"lora": {"rank": 16}}), 1, "NVIDIA H200") is None


def test_the_plan_prints_trainable_and_total_parameters_and_the_push(capsys):
    assert main(["plan", "--preset", "qwen2.5-32b-dapo-lora", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "1 node(s) x 8 H100 SXM = 8 ranks" in out
    assert "32,763,876,352 parameters in 771 tensors" in out
    # the adapters, and the 64 x 2 block norms and the final norm of 5,120 trained whole (lora.train_norms all)
    trained = 268_435_456 + 129 * 5120
    assert f"{trained:,} trainable of 33,032,311,808 parameters (0.81%" in out and "448 adapted linears" in out
    assert "129 norms trained whole" in out
    rows = {line[2:54].strip(): line[54:].split() for line in out.splitlines() if line.startswith("  ")}
    assert float(rows["frozen base, bf16 shards"][0]) == pytest.approx(
        2 * math.ceil(32_763_876_352 / 8) / GIB, abs=0.01)  # rank 0: ceil(d0 / 8) rows of every tensor
    assert float(rows["adapter AdamW moments, fp32"][0]) == pytest.approx(8 * trained / 8 / GIB, abs=0.02)
    assert "weight push to vLLM, per step: 1.08 GB (exact: the adapters and trained norms alone" in out
    assert "6 FLOPs per frozen base parameter and token (no weight gradient), 8 per adapter parameter" in out

"""`flashdapo plan` for mixture-of-experts models: total vs active parameters counted from the built-in
Qwen3-30B-A3B shape's config, expert shards laid out as the trainer lays them out (torch.chunk reference),
memory per GPU falling with trainer.expert_parallel, and the all-to-all bytes of a step as the formula says."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from flashdapo.__main__ import main
from flashdapo.config import PRESET_CLUSTERS, merge, preset, toy
from flashdapo.kernels.gpus import gpu_named
from flashdapo.plan.all_to_all import all_to_all_bytes, all_to_all_seconds, forward_exchanges, links_of
from flashdapo.plan.fit import train_setup
from flashdapo.plan.memory import TrainSetup, peak_training_bytes, state_bytes, transients
from flashdapo.plan.model import Tensor, build_meta_model, model_shape
from flashdapo.plan.shapes import ModelSource, builtin_shape
from flashdapo.plan.step_time import Workload, step_time
from tests.helpers.moe import tiny_moe_config
from tests.helpers.runs import torchrun

NAME = "Qwen3-30B-A3B"


@pytest.fixture(scope="module")
def a3b():
    return model_shape(build_meta_model(ModelSource(builtin_shape(NAME), NAME), toy()), NAME)


def _counts(c: dict, experts_run: int) -> int:
    """Parameters from config.json alone, with `experts_run` of each layer's experts counted."""
    h, hd, vocab = c["hidden_size"], c["head_dim"], c["vocab_size"]
    attention = h * c["num_attention_heads"] * hd * 2 + h * c["num_key_value_heads"] * hd * 2 + 2 * hd
    expert = 3 * h * c["moe_intermediate_size"]  # gate, up, down
    layer = attention + 2 * h + c["num_experts"] * h + experts_run * expert  # norms, router
    return vocab * h * (1 if c["tie_word_embeddings"] else 2) + h + c["num_hidden_layers"] * layer


def test_total_and_active_parameters_of_qwen3_30b_a3b_follow_its_config(a3b):
    c = builtin_shape(NAME)
    assert a3b.moe is not None and (a3b.moe.num_experts, a3b.moe.top_k, a3b.moe.moe_layers) == (128, 8, 48)
    assert a3b.parameters == _counts(c, c["num_experts"])
    assert a3b.active_parameters == _counts(c, c["num_experts_per_tok"])
    # the name's promise: ~30.5B in all, ~3.3B a token runs through
    assert 30.0e9 < a3b.parameters < 31.0e9 and 3.2e9 < a3b.active_parameters < 3.4e9
    assert {t.name.rsplit(".", 1)[-1] for t in a3b.tensors if t.expert} == {"gate_up_proj", "down_proj"}
    assert a3b.mlp_width == 8 * 768


@pytest.mark.parametrize(("world", "ep"), [(32, 8), (8, 8), (256, 8), (48, 4), (12, 4)])
def test_expert_shards_are_the_trainers_layout(world, ep):
    """Every rank's shard against the layout built with torch.chunk: rank r keeps experts of index r % ep,
    chunked over the world / ep ranks holding them on dim 0, or dim 1 when world > num_experts."""
    shape = (16, 6, 5)  # 16 experts: world 8..12 shards dim 0, 32 and more dim 1 (uneven chunks)
    tensor = Tensor("model.layers.0.mlp.experts.down_proj", shape, "layers.0", expert=True)
    full = torch.empty(shape, device="meta")
    dim = 1 if world > shape[0] else 0
    total = 0
    for rank in range(world):
        per = shape[0] // ep
        local = full[(rank % ep) * per:(rank % ep + 1) * per]
        chunks = torch.chunk(local, world // ep, dim=dim)
        expected = chunks[rank // ep].numel() if rank // ep < len(chunks) else 0
        assert tensor.shard_numel(world, rank, ep) == expected, rank
        total += expected
    assert total == tensor.numel
    assert tensor.shard_numel(world, 0, 1) == tensor.local_numel(world, 0)  # E = 1: FSDP2 alone


@pytest.mark.slow
def test_every_ranks_shard_is_what_the_trainers_parallelize_holds(tmp_path):
    """4 gloo ranks run the trainer's own `parallelize` on a tiny Qwen3-MoE (one MoE, one dense layer) at
    E = 2 with 4 experts (dim 0 sharded), 2 experts (world > experts: dim 1), and E = 1 (experts in their
    block's unit, 2 rows over 4 ranks: two empty shards); every parameter's local elements on every rank
    are the plan's count."""
    torchrun(4, "tests/plan/scripts/expert_shards.py", str(tmp_path), "4:2", "2:2", "2:1", timeout=600)
    for experts, ep in ((4, 2), (2, 2), (2, 1)):
        config = tiny_moe_config(vocab_size=37, num_experts=experts, mlp_only_layers=[1], moe_intermediate_size=5)
        with torch.device("meta"):
            shape = model_shape(Qwen3MoeForCausalLM(config), "tiny")
        assert sum(t.expert for t in shape.tensors) == 2
        for rank in range(4):
            measured = json.loads((tmp_path / f"{experts}x{ep}.rank{rank}.json").read_text())
            planned = {t.name: t.shard_numel(4, rank, ep) for t in shape.tensors}
            assert planned == measured, (experts, ep, rank)


def test_memory_per_gpu_falls_with_expert_parallelism(a3b):
    """The sharded state is ~1/world whatever E; what an all-gather of a block brings falls with E."""
    cfg = preset("qwen3-30b-a3b-dapo")
    world, gpu = 32, gpu_named("h100")
    base = train_setup(cfg, world, a3b, gpu, 22528)
    peaks, gathered = [], []
    for ep in (1, 2, 4, 8):
        setup = dataclasses.replace(base, expert_parallel=ep)
        state = state_bytes(a3b, world, 0, ep)
        assert state.params == pytest.approx(4 * a3b.parameters / world, rel=0.02)
        peaks.append(peak_training_bytes(a3b, setup, 22528))
        gathered.append(transients(a3b, setup, 22528).gathered)
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    # a block gathered: its non-expert tensors whole, 1/E of its experts
    experts = sum(t.numel for t in a3b.unit_tensors("layers.0") if t.expert)
    others = sum(t.numel for t in a3b.unit_tensors("layers.0") if not t.expert)
    root = sum(t.numel for t in a3b.unit_tensors("root"))
    assert gathered[-1] == 2 * (root + 2 * (others + experts // 8))


def _setup(ep: int, checkpointing: bool = True) -> TrainSetup:
    return TrainSetup(world=32, compute_bytes=2, offload=False, checkpointing=checkpointing,
                      reshard_after_forward=True, sequence_parallel=1, flash_attention=True, lm_head="fused",
                      device="cuda", expert_parallel=ep)


def test_all_to_all_bytes_are_zero_without_expert_parallelism_and_the_formula_at_eight(a3b):
    cfg = preset("qwen3-30b-a3b-dapo")
    world, gpu, work = 32, gpu_named("h100"), Workload(mean_response=4096, mean_prompt=256, mfu=0.4)
    tc = cfg.trainer
    tokens = tc.train_batch * cfg.rollout.n / world * (256 + 4096)
    # per MoE layer and forward: tokens x top_k x hidden x 2 bytes x 7/8 dispatched, as many combined;
    # backward twice that, recompute (checkpointing) once more, the old log-probs' forward once more
    forward = tokens * 8 * 2048 * 2 * 7 / 8 * 2 * 48
    at8 = step_time(a3b, cfg, world, gpu, None, "fused", work, gpus_per_node=8)
    assert at8.all_to_all_bytes == pytest.approx(forward * (2 + 1 + 1))
    assert at8.all_to_all == pytest.approx(at8.all_to_all_bytes / (links_of(gpu).nvlink_gbps * 1e9))
    assert at8.total == pytest.approx(at8.generation + at8.old_logprobs + at8.update + at8.lm_head + at8.all_to_all)
    at1 = step_time(a3b, merge(cfg, {"trainer": {"expert_parallel": 1}}), world, gpu, None, "fused", work, 8)
    assert at1.all_to_all_bytes == 0 and at1.all_to_all == 0
    assert forward_exchanges(checkpointing=False, ppo_epochs=2, old_logprobs=False) == 4
    # peers off the node go at the network's rate: 4 of 7 peers of a group of 8 over nodes of 4
    sent = all_to_all_bytes(a3b, tokens, 8, 2, 1)
    assert all_to_all_seconds(sent, 8, 4, links_of(gpu)) == pytest.approx(sent * 4 / 7 / 50e9)


def test_the_update_counts_active_not_total_parameters(a3b):
    """Dense FLOPs per token: the active parameters (an MoE model is ~9x cheaper than its total says)."""
    cfg = merge(preset("qwen3-30b-a3b-dapo"), {"trainer": {"expert_parallel": 1}})
    work, gpu = Workload(mean_response=64, mean_prompt=32, mfu=0.5), gpu_named("h200")
    moe = step_time(a3b, cfg, 32, gpu, None, "fused", work)
    dense = step_time(dataclasses.replace(a3b, moe=None,
                                          tensors=tuple(dataclasses.replace(t, expert=False) for t in a3b.tensors)),
                      cfg, 32, gpu, None, "fused", work)
    head = 2 * a3b.lm_head_parameters
    assert moe.update / dense.update == pytest.approx((a3b.active_parameters - head) / (a3b.parameters - head),
                                                      rel=0.05)


def _tiny_moe(tmp_path, experts: int) -> str:
    """A two-layer Qwen3-MoE config.json of `experts` experts (the second layer dense)."""
    values = dict(builtin_shape(NAME), hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  num_experts=experts, num_experts_per_tok=2, mlp_only_layers=[1], vocab_size=64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    return str(path)


@pytest.mark.parametrize(("args", "expected"), [
    (["--preset", "qwen3-30b-a3b-dapo", "--trainer.expert-parallel", "3"],
     "trainer.expert_parallel: 3 does not divide the world size 32"),
    (["--preset", "qwen2.5-7b-math", "--trainer.expert-parallel", "8"], "the model has no MoE layer"),
    (["--preset", "toy", "--trainer.expert-parallel", "4", "--nodes", "1", "--gpus-per-node", "8", "--model-config",
      "TINY6"], "must divide the model's num_experts 6"),
])
def test_expert_parallelism_the_launch_refuses_is_one_line(args, expected, capsys, tmp_path):
    args = [_tiny_moe(tmp_path, 6) if a == "TINY6" else a for a in args]
    status = main(["plan", *args])
    err = capsys.readouterr().err
    assert status == 1 and err.count("\n") == 1 and expected in err, err


def test_a_model_with_dense_and_moe_layers_plans_with_expert_parallelism(capsys, tmp_path):
    """Layer 0 routed (8 experts, top 2), layer 1 dense: both widths known, the exchange in one layer."""
    status = main(["plan", "--preset", "toy", "--trainer.expert-parallel", "4", "--nodes", "1", "--gpus-per-node",
                   "8", "--model-config", _tiny_moe(tmp_path, 8)])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "8 routed experts of width 16 in 1 of 2 layers, top 2" in out and "expert_parallel 4: 2 experts" in out


def test_the_preset_plan_reports_experts_and_the_exchange(capsys):
    cluster = PRESET_CLUSTERS["qwen3-30b-a3b-dapo"][0]
    assert main(["plan", "--preset", "qwen3-30b-a3b-dapo"]) == 0
    out = capsys.readouterr().out
    assert f"= {cluster.world_size} ranks" in out
    assert "active parameters per token" in out and "expert_parallel 8: 16 experts" in out
    assert "expert all-to-all, expert_parallel 8" in out

"""Tiny Qwen3-MoE models (4 experts, top-2, 2 layers): as modules, saved as an HF directory with the toy
task's tokenizer, and one trained on a fixed batch by however many ranks run it (tests/trainer/scripts/
moe_update.py)."""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from flashdapo.config import ToyTaskConfig, merge, toy
from flashdapo.distributed.collectives import all_reduce
from flashdapo.distributed.mesh import init_distributed, shutdown
from flashdapo.models.moe import routers
from flashdapo.models.parallelize import parallelize
from flashdapo.models.policy import PolicyModel
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.tasks.toy import build_toy_tokenizer
from flashdapo.trainer.batch import Group, build_train_batch
from flashdapo.trainer.collect.dealing import deal_to_slots
from flashdapo.trainer.update import compute_old_logprobs, update_actor


@contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread inside (as flashdapo runs a model this small: tools/threads.py): the tiny experts'
    scatter and gather ops are 10x slower on two threads of a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_moe_config(vocab_size: int = 50, **overrides) -> Qwen3MoeConfig:
    """4 experts, top-2, 2 sparse layers, hidden 16; the eager experts loop (grouped_mm takes no float64)."""
    shape = dict(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
                 num_experts_per_tok=2, max_position_embeddings=128, router_aux_loss_coef=0.01,
                 experts_implementation="eager")
    return Qwen3MoeConfig(**{**shape, **overrides})


def tiny_moe(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> Qwen3MoeForCausalLM:
    """A random tiny Qwen3-MoE; its routers' weights scaled up so that routing is far from uniform."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config(**overrides)).to(dtype)
    with torch.no_grad():
        for router in routers(model):
            router.weight.mul_(50.0)
    return model


def tiny_deepseek(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> DeepseekV3ForCausalLM:
    """A random tiny DeepSeek-V3: multi-head latent attention (q/kv low-rank, rope and nope parts, v_head_dim
    6), layer 0 dense, layer 1 four routed experts in 2 groups, top-2, a shared expert."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=50, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                 num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                 q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, max_position_embeddings=128,
                 experts_implementation="eager")
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**shape, **overrides})).to(dtype)
    with torch.no_grad():
        for router in routers(model):
            router.weight.mul_(50.0)
    return model


def tiny_gpt_oss(dtype: torch.dtype = torch.float64, **overrides) -> GptOssForCausalLM:
    """A random 2-layer GPT-OSS (4 experts, top-2, a sliding layer of window 4 then a full one, sinks), eager
    attention and experts; routers and sinks scaled up so that routing is far from uniform and sinks matter."""
    torch.manual_seed(0)
    shape = dict(vocab_size=50, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                 sliding_window=4, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
                 router_aux_loss_coef=0.01, initializer_range=0.2, experts_implementation="eager")
    model = GptOssForCausalLM(GptOssConfig(**{**shape, **overrides})).to(dtype)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for router in routers(model):
            router.weight.mul_(20.0)
            router.bias.normal_(0.0, 1.0)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model.eval()


def moe_model_dir(path: Path, **overrides) -> Path:
    """A tiny random Qwen3-MoE with the toy tokenizer, saved as an HF directory (float32)."""
    tok = build_toy_tokenizer(ToyTaskConfig())
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_moe_config(vocab_size=len(tok), max_position_embeddings=64,
                                                     **overrides)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


VOCAB, GROUPS, N = 50, 4, 2
"""fixed_batch_update's batch: vocabulary, groups, responses per group."""


def fixed_batch_update(out: Path, layout: str, sp: int = 1, coef: float | None = 0.5, family: str = "qwen3_moe",
                       checkpointing: bool = False) -> None:
    """A tiny Qwen3-MoE (float64) trained on one fixed rollout batch with the routers' load-balancing loss
    (coefficient `coef`), by this process's ranks (torchrun's, or one without it), in `layout` (packed | padded)
    with sequence parallelism `sp`: 4 groups of 2, 2 per mini-batch, 2 epochs (4 optimizer steps, off-policy
    after the first). Rank 0 writes out/moe.json (per optimizer step the global pg_loss, the loss
    backpropagated, the router loss and the grad norm; the expert load summed over the ranks), params.pt and
    initial.pt (full tensors). On one intra-op thread. `family`: qwen3_moe (tiny_moe) or deepseek_v3
    (tiny_deepseek, no router loss); `checkpointing`: activation checkpointing of the decoder blocks."""
    g = torch.Generator().manual_seed(5)
    groups = []
    for _ in range(GROUPS):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g)
        responses = [torch.randint(3, VOCAB, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g)
                     for _ in range(N)]
        groups.append(Group(prompt, responses, torch.tensor([1.0, -1.0]), torch.tensor([True, False]),
                            torch.zeros(N, dtype=torch.bool), origin=(1, 0, len(groups))))
    cfg = merge(toy(), {
        "model": {"router_aux_loss_coef": coef, "gradient_checkpointing": checkpointing},
        "rollout": {"n": N},
        "trainer": {"train_batch": GROUPS, "gen_batch": GROUPS, "mini_batch": 2, "ppo_epochs": 2,
                    "micro_batch_tokens": 24, "kernel_impl": "torch", "sequence_parallel": sp,
                    "pack_sequences": layout == "packed"},
        "optim": {"lr": 1e-2, "warmup_steps": 1, "weight_decay": 0.1},
    })
    with one_thread():
        env = init_distributed("cpu", sequence_parallel=sp)
        try:
            model = tiny_moe(vocab_size=VOCAB) if family == "qwen3_moe" else tiny_deepseek(vocab_size=VOCAB)
            policy = parallelize(PolicyModel(model, "sdpa", "torch", 1.0), env, cfg.model, cfg.trainer)
            optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
            initial = {name: t.clone() for name, t in iter_full_state_dict(policy.hf)}
            mine = deal_to_slots(groups, cfg.trainer.mini_batch, env.dp_size, env.dp_rank,
                                 cfg.algorithm.advantage_eps)
            pieces = [g for part in mine for g in part]
            old_logprobs = compute_old_logprobs(policy, pieces, cfg, pad_id=0, device=env.device)
            batch = build_train_batch(mine, old_logprobs, cfg.algorithm, "none")
            result = update_actor(policy, optimizer, batch, cfg, env, pad_id=0)
            load = [] if result.expert_load is None else all_reduce(result.expert_load).tolist()
            params = {name: t.clone() for name, t in iter_full_state_dict(policy.hf)}
            if env.is_main:
                (out / "moe.json").write_text(json.dumps({
                    "pg_loss": result.pg_losses, "loss": result.losses, "aux": result.router_aux_losses,
                    "grad_norm": result.grad_norms, "load": load}))
                torch.save(params, out / "params.pt")
                torch.save(initial, out / "initial.pt")
        finally:
            shutdown()

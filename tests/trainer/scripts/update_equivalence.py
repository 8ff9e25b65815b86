"""torchrun script: one fixed rollout batch, trained by however many ranks torchrun starts, once per
(loss aggregation mode, rollout correction) pair. argv: OUT_DIR MICRO_BATCH_TOKENS [MINI_BATCH, default 2]
[LORA_RANK, default 0: with a rank, LoRA adapters (lora_B drawn non-zero, so both A and B get gradients) on the
toy model, and the first two pairs only].

Writes, per pair, losses_<mode>_<correction>.json (per optimizer step: global pg_loss and grad norm, and
the number of micro-batches of each optimizer step) and params_<mode>_<correction>.pt (full tensors); and
initial.pt."""

import json
import sys
from pathlib import Path

import torch

import flashdapo.trainer.update as update
from flashdapo.config import LoraConfig, merge, toy
from flashdapo.distributed.mesh import init_distributed, shutdown
from flashdapo.models.lora import add_adapters
from flashdapo.models.parallelize import parallelize
from flashdapo.models.policy import PolicyModel
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.tasks.toy import build_toy_model
from flashdapo.trainer.batch import Group, build_train_batch
from flashdapo.trainer.collect.dealing import deal_to_slots
from flashdapo.trainer.observe.correction import rollout_correction_metrics
from flashdapo.trainer.update import compute_old_logprobs, update_actor

PAIRS = [("token-mean", "none"), ("seq-mean-token-mean", "token_truncate"), ("seq-mean-token-sum", "sequence_mask"),
         ("token-mean-per-micro-batch", "token_mask"), ("token-mean", "sequence_truncate")]

out, budget = Path(sys.argv[1]), int(sys.argv[2])
mini_batch = int(sys.argv[3]) if len(sys.argv) > 3 else 2
lora_rank = int(sys.argv[4]) if len(sys.argv) > 4 else 0
if lora_rank:
    PAIRS = PAIRS[:2]
VOCAB, GROUPS, N = 50, 8, 4
env = init_distributed("cpu")

micro_counts: list[int] = []
plan = update.plan_micro_batches
update.plan_micro_batches = lambda *a, **k: (lambda bins: micro_counts.append(len(bins)) or bins)(plan(*a, **k))

g = torch.Generator().manual_seed(123)
groups, offsets = [], []
for _ in range(GROUPS):
    prompt = torch.randint(3, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g)
    responses = [torch.randint(3, VOCAB, (int(torch.randint(1, 16, (1,), generator=g)),), generator=g)
                 for _ in range(N)]
    acc = torch.rand(N, generator=g) > 0.5
    acc[0], acc[1] = True, False
    groups.append(Group(prompt, responses, torch.where(acc, 1.0, -1.0) - 0.1 * torch.rand(N, generator=g), acc,
                        torch.zeros(N, dtype=torch.bool), origin=(1, 0, len(groups))))
    # log(pi_old / pi_rollout) per token, in [-0.9, 0.9]: the rollout engine's log-probs are set from it below.
    offsets.append([torch.empty(len(r)).uniform_(-0.9, 0.9, generator=g) for r in responses])

for mode, correction in PAIRS:
    cfg = merge(toy(), {
        "model": {"toy": {"hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "num_kv_heads": 2}},
        "rollout": {"n": N},
        "algorithm": {"loss_agg_mode": mode, "loss_agg_micro_batch": 3, "rollout_correction": correction,
                      "rollout_correction_cap": 1.5},
        # 8 groups, 2 per mini-batch (by default): 4 optimizer steps per epoch, 2 epochs.
        "trainer": {"train_batch": GROUPS, "gen_batch": GROUPS, "mini_batch": mini_batch, "ppo_epochs": 2,
                    "micro_batch_tokens": budget, "kernel_impl": "torch"},
        "optim": {"lr": 1e-2, "warmup_steps": 1, "weight_decay": 0.1},
    })
    # float64: the comparison is about the algebra (normalizer, reduction), not fp32 summation order. (In
    # fp32 the parameters agree to ~3e-6 relative, except k_proj.bias: its true gradient is exactly zero
    # (softmax shift invariance), so Adam turns rounding noise into steps of its own.)
    model = build_toy_model(cfg.model, VOCAB, 128, seed=0).to(torch.float64)
    if lora_rank:
        add_adapters(model, LoraConfig(rank=lora_rank, alpha=8.0), seed=1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    policy = parallelize(PolicyModel(model, "sdpa", "torch", 1.0), env, cfg.model, cfg.trainer)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                  weight_decay=cfg.optim.weight_decay)
    initial = {name: t.clone() for name, t in iter_full_state_dict(policy.hf)}
    # Responses dealt to the ranks balanced by tokens: on 2 ranks groups split between them.
    mine = deal_to_slots(groups, cfg.trainer.mini_batch, env.world_size, env.rank, cfg.algorithm.advantage_eps)
    old_logprobs = compute_old_logprobs(policy, [g for part in mine for g in part], cfg, pad_id=0, device=env.device)
    flat = iter(old_logprobs)
    for piece in (g for part in mine for g in part):
        piece.sampler_logprobs = [next(flat) - offsets[piece.origin[2]][m] for m in piece.member_indices]
    batch = build_train_batch(mine, old_logprobs, cfg.algorithm, correction)
    correction_metrics = rollout_correction_metrics(batch)
    micro_counts.clear()
    result = update_actor(policy, optimizer, batch, cfg, env, pad_id=0)
    params = {name: t.clone() for name, t in iter_full_state_dict(policy.hf)}
    if env.is_main:
        (out / f"losses_{mode}_{correction}.json").write_text(json.dumps({
            "pg_loss": result.pg_losses, "grad_norm": result.grad_norms, "micro_batches": list(micro_counts),
            "clipfrac": result.stats.means()["pg_clipfrac"], "stats": result.stats.means(), **correction_metrics}))
        torch.save(params, out / f"params_{mode}_{correction}.pt")
        torch.save(initial, out / "initial.pt")
shutdown()

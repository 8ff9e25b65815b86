"""torchrun script: one fixed rollout batch of skewed lengths (a response longer than a rank's shard), trained
by the ranks torchrun starts with trainer.sequence_parallel SP, for two loss aggregation modes.
argv: OUT_DIR MICRO_BATCH_TOKENS SP (MICRO_BATCH_TOKENS is per rank: give sp=1 on one rank sp times the budget
of sp=2, so both cut the same micro-batches; with SP=1 on two ranks the ranks' shares need different numbers
of micro-batches).

Writes, per mode, sp_<mode>.json (global pg_loss and grad norm per optimizer step, the old log-probs, the
micro-batch count per pass) and params_<mode>.pt (full tensors), and initial.pt; every rank writes
rank<r>_<mode>.json: the micro-batches of each pass it ran, how many its share alone needed, and the old
log-probs of the responses it was dealt, by "group/response"."""

import json
import sys
from pathlib import Path

import torch

import flashdapo.trainer.update as update
from flashdapo.config import merge, toy
from flashdapo.distributed.mesh import init_distributed, shutdown
from flashdapo.models.parallelize import parallelize
from flashdapo.models.policy import PolicyModel
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.tasks.toy import build_toy_model
from flashdapo.trainer.batch import Group, _first_fit_count, build_train_batch
from flashdapo.trainer.collect.dealing import deal_to_slots
from flashdapo.trainer.update import compute_old_logprobs, update_actor

out, budget, sp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
VOCAB, GROUPS, N = 50, 4, 2
env = init_distributed("cpu", sequence_parallel=sp)

micro_counts: list[int] = []
needed: list[int] = []
plan = update.plan_micro_batches


def recording_plan(token_counts, budget, padded=False):
    bins = plan(token_counts, budget, padded)
    micro_counts.append(len(bins))
    needed.append(_first_fit_count(token_counts, budget))  # what this rank's share alone would take
    return bins


update.plan_micro_batches = recording_plan


def counting_token_batch(make_batch, without_targets: list[int]):
    def token_batch(*args):
        batch = make_batch(*args)
        without_targets.append(int(not len(batch.targets)))
        return batch
    return token_batch

g = torch.Generator().manual_seed(7)
LENGTHS = [(5, [150, 3]), (60, [4, 2]), (2, [77, 12]), (14, [6, 60])]  # (prompt, responses) per group
groups = []
for prompt_len, response_lens in LENGTHS:
    prompt = torch.randint(3, VOCAB, (prompt_len,), generator=g)
    responses = [torch.randint(3, VOCAB, (n,), generator=g) for n in response_lens]
    groups.append(Group(prompt, responses, torch.tensor([1.0, -1.0]), torch.tensor([True, False]),
                        torch.zeros(N, dtype=torch.bool), origin=(1, 0, len(groups))))

for mode in ("token-mean", "seq-mean-token-mean"):
    cfg = merge(toy(), {
        "model": {"toy": {"hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "num_kv_heads": 2},
                  "gradient_checkpointing": True},
        "rollout": {"n": N},
        "algorithm": {"loss_agg_mode": mode},
        # 4 groups, 2 per mini-batch, 2 epochs: 4 optimizer steps, off-policy after the first (old log-probs).
        "trainer": {"train_batch": GROUPS, "gen_batch": GROUPS, "mini_batch": 2, "ppo_epochs": 2,
                    "micro_batch_tokens": budget, "kernel_impl": "torch", "sequence_parallel": sp},
        "optim": {"lr": 1e-2, "warmup_steps": 1, "weight_decay": 0.1},
    })
    model = build_toy_model(cfg.model, VOCAB, 512, seed=0).to(torch.float64)  # float64: see update_equivalence.py
    policy = parallelize(PolicyModel(model, "sdpa", "torch", 1.0), env, cfg.model, cfg.trainer)
    shards_without_targets: list[int] = []  # sp > 1: micro-batches whose shard here predicts no token
    policy.token_batch = counting_token_batch(policy.token_batch, shards_without_targets)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    initial = {name: t.clone() for name, t in iter_full_state_dict(policy.hf)}
    mine = deal_to_slots(groups, cfg.trainer.mini_batch, env.dp_size, env.dp_rank, cfg.algorithm.advantage_eps)
    micro_counts.clear()
    needed.clear()
    old_logprobs = compute_old_logprobs(policy, [g for part in mine for g in part], cfg, pad_id=0, device=env.device)
    batch = build_train_batch(mine, old_logprobs, cfg.algorithm)
    result = update_actor(policy, optimizer, batch, cfg, env, pad_id=0)
    params = {name: t.clone() for name, t in iter_full_state_dict(policy.hf)}
    keyed = {f"{key[0][2]}/{key[1]}": lp.tolist() for key, lp in zip(batch.response_keys, old_logprobs)}
    (out / f"rank{env.rank}_{mode}.json").write_text(json.dumps({"micro_batches": micro_counts,
                                                                 "needed": needed, "old_logprobs": keyed,
                                                                 "shards_without_targets": sum(shards_without_targets)}))
    if env.is_main:
        (out / f"sp_{mode}.json").write_text(json.dumps({
            "pg_loss": result.pg_losses, "grad_norm": result.grad_norms, "micro_batches": list(micro_counts),
            "old_logprobs": [lp.tolist() for lp in old_logprobs]}))
        torch.save(params, out / f"params_{mode}.pt")
        torch.save(initial, out / "initial.pt")
shutdown()

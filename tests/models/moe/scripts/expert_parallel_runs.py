"""torchrun script: a tiny Qwen3-MoE (float64, 4 experts, top-2) trained on one fixed rollout batch with
trainer.expert_parallel E, its full state dumped, checkpointed, and checkpoints of other layouts loaded; and
the expert-parallel dispatch of one experts module against HF's forward. argv: OUT_DIR PART.

PART "two" (2 ranks): the dispatch cases (dispatch.pt, see `dispatch_cases`); train at E = 1 and at E = 2
(dumps e1, e2; initial_e1, initial_e2 before training), checkpoint both (ckpt_e1/, ckpt_e2/); load ckpt_e1 into a
fresh, differently seeded E = 2 model (dump e2_from_e1); load the model directory OUT_DIR/model_dir (written
here) at E = 2 through the trainer's loader, rank 1 on the meta device (dump loaded).
PART "one" (1 rank): train (dump one); load ckpt_e2 into a fresh E = 1 model (dump one_from_e2).
PART "four" (4 ranks): train at E = 2, two expert-parallel groups (dump e2x4).

A dump NAME is NAME.json (global pg_loss and grad norm per optimizer step, every response's old log-probs by
"group/response", per rank the mesh dimensions and local row count of the first experts' gate_up_proj) and
NAME.pt: full HF-named parameters ("param/<name>") and AdamW state ("optim/<name>/<key>"), on rank 0."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from transformers import Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from flashdapo.config import merge, toy
from flashdapo.distributed.collectives import all_gather_objects
from flashdapo.distributed.mesh import expert_parallel_mesh, init_distributed, shutdown
from flashdapo.models.loading import load_sharded_policy
from flashdapo.models.moe.expert_parallel import expert_modules, shard_experts
from flashdapo.models.parallelize import parallelize
from flashdapo.models.policy import PolicyModel
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.trainer.batch import Group, build_train_batch
from flashdapo.trainer.collect.dealing import deal_to_slots
from flashdapo.trainer.state.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from flashdapo.trainer.update import compute_old_logprobs, update_actor
from tests.helpers.moe import moe_model_dir, tiny_moe_config

out, part = Path(sys.argv[1]), sys.argv[2]
VOCAB, N = 50, 2
env = init_distributed("cpu")

g = torch.Generator().manual_seed(11)
LENGTHS = [(5, [9, 3]), (7, [4, 12]), (3, [7, 1]), (6, [5, 8])]  # (prompt, responses) per group
GROUPS = []
for prompt_len, response_lens in LENGTHS:
    prompt = torch.randint(3, VOCAB, (prompt_len,), generator=g)
    responses = [torch.randint(3, VOCAB, (n,), generator=g) for n in response_lens]
    GROUPS.append(Group(prompt, responses, torch.tensor([1.0, -1.0]), torch.tensor([True, False]),
                        torch.zeros(N, dtype=torch.bool), origin=(1, 0, len(GROUPS))))


def dispatch_cases() -> dict:
    """The expert-parallel forward of one Qwen3-MoE experts module (E = 2, no FSDP2) against HF's own forward
    of the whole module, on random routings, forward and backward. Cases: every expert used; expert 3 (rank
    1's second) never chosen; no token routed to rank 1's experts at all; rank 1 with no token of its own
    (T = 0). Per case and rank: the largest absolute difference of the output and of the gradients (hidden
    states, routing weights, each expert weight); and which experts each rank held."""
    torch.manual_seed(0)
    reference = Qwen3MoeExperts(tiny_moe_config()).double()  # 4 experts, hidden 16, moe_intermediate 8
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.3)
    sharded = Qwen3MoeExperts(tiny_moe_config()).double()
    sharded.load_state_dict(reference.state_dict())
    shard_experts(sharded, expert_parallel_mesh(env, 2)["ep"])
    local = sharded.gate_up_proj.to_local()
    results = {"held": all_gather_objects([e for e in range(4) if any(torch.equal(row, reference.gate_up_proj[e])
                                                                        for row in local)])}
    # case: (tokens of rank 0, tokens of rank 1, the experts a routing may choose)
    cases = {"all": (7, 5, [0, 1, 2, 3]), "expert 3 unused": (6, 9, [0, 1, 2]),
             "rank 1 gets nothing": (8, 3, [0, 1]), "rank 1 has no tokens": (5, 0, [0, 1, 2, 3])}
    for number, (name, (t0, t1, choices)) in enumerate(cases.items()):
        g = torch.Generator().manual_seed(100 * number + env.rank)
        tokens = (t0, t1)[env.rank]
        hidden = torch.randn(tokens, 16, dtype=torch.float64, generator=g, requires_grad=True)
        pool = torch.tensor(choices)
        index = torch.stack([pool[torch.randperm(len(choices), generator=g)[:2]] for _ in range(tokens)]) \
            if tokens else torch.zeros(0, 2, dtype=torch.long)
        weights = torch.rand(tokens, 2, dtype=torch.float64, generator=g).requires_grad_()
        got = sharded(hidden, index, weights)
        upstream = torch.randn(got.shape, dtype=torch.float64, generator=g)
        grads = torch.autograd.grad((got * upstream).sum(), [hidden, weights, sharded.gate_up_proj,
                                                             sharded.down_proj])
        # HF's forward of the whole module on this rank's tokens; the expert gradients summed over both ranks'
        # tokens are what each rank's shard must hold for its experts.
        expected = reference(hidden, index, weights)
        inputs = [hidden, weights, reference.gate_up_proj, reference.down_proj]
        tie = sum(t.sum() for t in inputs) * 0.0  # with no token HF's output has no graph: zero gradients
        ref_grads = torch.autograd.grad((expected * upstream).sum() + tie, inputs)
        summed = [grad.clone() for grad in ref_grads[2:]]
        for grad in summed:
            dist.all_reduce(grad)
        diffs = {"output": (got - expected).abs().max().item() if tokens else 0.0,
                 "hidden grad": (grads[0] - ref_grads[0]).abs().max().item() if tokens else 0.0,
                 "weight grad": (grads[1] - ref_grads[1]).abs().max().item() if tokens else 0.0}
        for label, grad, full in zip(("gate_up_proj grad", "down_proj grad"), grads[2:], summed):
            diffs[label] = (grad.full_tensor() - full).abs().max().item()
        diffs["expert grads norm"] = sum(grad.norm().item() for grad in summed)
        results[name] = all_gather_objects(diffs)
    return results


def config(ep: int, **model):
    return merge(toy(), {
        # Activation checkpointing: backward recomputes each block's forward, all-to-alls included.
        "model": {"gradient_checkpointing": True, **model},
        "rollout": {"n": N},
        # 4 groups, 2 per mini-batch, 2 epochs: 4 optimizer steps, off-policy after the first (old log-probs).
        "trainer": {"train_batch": 4, "gen_batch": 4, "mini_batch": 2, "ppo_epochs": 2, "micro_batch_tokens": 24,
                    "kernel_impl": "torch", "expert_parallel": ep},
        # grad_clip below the gradient norms (0.5 to 1): the clipping over the two meshes scales every step.
        "optim": {"lr": 1e-2, "warmup_steps": 1, "weight_decay": 0.1, "grad_clip": 0.3},
    })


def model(seed: int):
    """The tiny Qwen3-MoE, float64. Its routers as initialized (not sharpened): the LM head's fp32 log-probs
    differ between 1 and 2 ranks by rounding, and a sharp router would turn that into a different top-2."""
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(tiny_moe_config(vocab_size=VOCAB, initializer_range=0.2)).to(torch.float64)


def build(ep: int, seed: int = 0):
    cfg = config(ep)
    policy = parallelize(PolicyModel(model(seed), "sdpa", "torch", 1.0), env, cfg.model, cfg.trainer)
    return cfg, policy, torch.optim.AdamW(policy.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)


def train(cfg, policy, optimizer) -> dict:
    mine = deal_to_slots(GROUPS, cfg.trainer.mini_batch, env.dp_size, env.dp_rank, cfg.algorithm.advantage_eps)
    old = compute_old_logprobs(policy, [g for part in mine for g in part], cfg, pad_id=0, device=env.device)
    batch = build_train_batch(mine, old, cfg.algorithm)
    result = update_actor(policy, optimizer, batch, cfg, env, pad_id=0)
    keyed = {f"{key[0][2]}/{key[1]}": lp.tolist() for key, lp in zip(batch.response_keys, old)}
    every = all_gather_objects(keyed)
    return {"pg_loss": result.pg_losses, "grad_norm": result.grad_norms,
            "old_logprobs": {k: v for rank in every for k, v in rank.items()}}


def dump(name: str, policy, optimizer=None, record: dict | None = None) -> None:
    state = {f"param/{n}": t.clone() for n, t in iter_full_state_dict(policy.hf)}
    if optimizer is not None:
        full = get_optimizer_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True))
        for fqn, moments in full["state"].items():
            for key, value in moments.items():
                state[f"optim/{fqn.removeprefix('hf.')}/{key}"] = torch.as_tensor(value).clone()
    weight = expert_modules(policy.hf)[0].gate_up_proj
    layout = {"mesh": list(weight.device_mesh.mesh_dim_names) if isinstance(weight, DTensor) else [],
              "rows": (weight.to_local() if isinstance(weight, DTensor) else weight).shape[0]}
    layouts = all_gather_objects(layout)
    if env.is_main:
        torch.save(state, out / f"{name}.pt")
        (out / f"{name}.json").write_text(json.dumps({**(record or {}), "layout": layouts}))


def checkpoint(name: str, policy, optimizer) -> Path:
    state = TrainerState(step=1, scheduler={}, sampler={}, run_id=name)
    return save_checkpoint(out / name, env, policy, optimizer, state, keep_last=1)


if part == "two":
    dispatched = dispatch_cases()
    if env.is_main:
        torch.save(dispatched, out / "dispatch.pt")
    for ep in (1, 2):
        cfg, policy, optimizer = build(ep)
        dump(f"initial_e{ep}", policy)
        record = train(cfg, policy, optimizer)
        dump(f"e{ep}", policy, optimizer, record)
        checkpoint(f"ckpt_e{ep}", policy, optimizer)
    cfg, policy, optimizer = build(2, seed=1)
    load_checkpoint(out / "ckpt_e1" / "checkpoints" / "step_00000001", env, policy, optimizer)
    dump("e2_from_e1", policy, optimizer)
    if env.is_main:
        moe_model_dir(out / "model_dir")
    dist.barrier()
    cfg = config(2, path=str(out / "model_dir"), attn_implementation="sdpa")
    dump("loaded", load_sharded_policy(cfg, env))
elif part == "four":  # two expert-parallel groups: each expert on 2 ranks, FSDP2 over them ("efsdp" = 2)
    cfg, policy, optimizer = build(2)
    dump("e2x4", policy, optimizer, train(cfg, policy, optimizer))
else:
    cfg, policy, optimizer = build(1)
    dump("one", policy, optimizer, train(cfg, policy, optimizer))
    cfg, policy, optimizer = build(1, seed=1)
    load_checkpoint(out / "ckpt_e2" / "checkpoints" / "step_00000001", env, policy, optimizer)
    dump("one_from_e2", policy, optimizer)
shutdown()

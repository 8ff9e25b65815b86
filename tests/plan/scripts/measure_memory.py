"""torchrun script: one optimizer step of the trainer's update on however many gloo ranks torchrun starts,
with every tensor's memory tracked by torch's FSDP2 memory tracker (torch.distributed._tools.fsdp2_mem_tracker).
argv: OUT_DIR CASE, CASE one of
  toy:       the toy model (real tensors) through `update_actor`: packed micro-batch, the CPU's fused LM-head
             sweep, gradient clipping, AdamW;
  qwen0.5b:  Qwen2.5-0.5B's exact shape under FakeTensorMode (no memory, no arithmetic; shapes, dtypes and
             allocations as real): the HF forward of one 64-token row, a log-softmax loss, backward, AdamW.
Writes rank<R>.json: the bytes of this rank's parameter shards, gradients (before the step) and AdamW state
(after it), each summed over the local tensors, and the tracker's peak with its breakdown."""

import json
import sys
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.tensor import DTensor

from flashdapo.config import merge, toy
from flashdapo.plan.shapes import builtin_shape
from flashdapo.tasks.toy import build_toy_model
from flashdapo.trainer.batch import Group, build_train_batch, mini_batch_layout
from flashdapo.trainer.distributed import init_distributed, shutdown
from flashdapo.trainer.policy import PolicyModel, parallelize
from flashdapo.trainer.update import update_actor

out, case = Path(sys.argv[1]), sys.argv[2]
env = init_distributed("cpu")
GROUPS, N = 2, 8


def local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


measured = {}


def before_step(optimizer, *_):
    measured["grads"] = local_bytes(p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)


def after_step(optimizer, *_):
    states = [s for s in optimizer.state.values()]
    measured["moments"] = local_bytes(s[k] for s in states for k in ("exp_avg", "exp_avg_sq"))
    measured["steps"] = local_bytes(s["step"] for s in states)


if case == "toy":
    cfg = merge(toy(), {"rollout": {"n": N}, "trainer": {"train_batch": GROUPS, "gen_batch": GROUPS,
                                                         "mini_batch": GROUPS, "micro_batch_tokens": 100000}})
    cfg = replace(cfg, model=replace(cfg.model, gradient_checkpointing=True))
    vocab = 289
    hf = build_toy_model(cfg.model, vocab, 4096, seed=0)
    fake = nullcontext()
else:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = merge(toy(), {"model": {"path": "checkpoints/Qwen2.5-0.5B", "gradient_checkpointing": True},
                        "data": {"train_files": ["unused.jsonl"]}})
    values = builtin_shape("Qwen2.5-0.5B")
    config = AutoConfig.for_model("qwen2", **{k: v for k, v in values.items() if k not in ("architectures", "model_type")})
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
with fake:
    policy = parallelize(PolicyModel(hf, "sdpa", cfg.trainer.kernel_impl, 1.0), env, cfg.model, cfg.trainer)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
    measured["params"] = local_bytes(policy.parameters())
    tracker = FSDPMemTracker(policy, optimizer)
    with tracker:
        if case == "toy":
            g = torch.Generator().manual_seed(7)
            groups = []
            for _ in range(GROUPS):
                prompt = torch.randint(3, vocab, (int(torch.randint(40, 80, (1,), generator=g)),), generator=g)
                responses = [torch.randint(3, vocab, (int(torch.randint(100, 300, (1,), generator=g)),), generator=g)
                             for _ in range(N)]
                acc = torch.arange(N) % 2 == 0
                groups.append(Group(prompt, responses, torch.where(acc, 1.0, -1.0), acc, torch.zeros(N, dtype=torch.bool)))
            layout = mini_batch_layout(GROUPS, GROUPS, env.world_size, env.rank)
            mine = [[groups[i] for i in part] for part in layout]
            batch = build_train_batch(mine, None, cfg.algorithm)
            measured["tokens"] = sum(len(p) + len(r) - 1 for p, r in zip(batch.prompts, batch.responses))
            update_actor(policy, optimizer, batch, cfg, env, pad_id=0)
        else:
            ids = torch.randint(0, 1000, (1, 64))
            logits = policy(input_ids=ids, use_cache=False).logits
            torch.log_softmax(logits.float(), -1)[0, :-1].gather(1, ids[0, 1:, None]).sum().backward()
            del logits
            optimizer.step()
            measured["tokens"] = 64
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
measured["peak"] = {str(getattr(k, "value", k)): v for k, v in peak.items()}
(out / f"rank{env.rank}.json").write_text(json.dumps(measured))
shutdown()

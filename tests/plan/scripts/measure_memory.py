"""torchrun script: one optimizer step on however many gloo ranks torchrun starts, every tensor's memory
tracked by torch's FSDP2 memory tracker (torch.distributed._tools.fsdp2_mem_tracker). argv: OUT_DIR CASE ...
  toy:       the toy model (real tensors) through the trainer's `update_actor`: a packed micro-batch of two
             groups of 8 responses, the CPU's fused LM-head sweep, gradient clipping, AdamW;
  qwen0.5b:  Qwen2.5-0.5B's exact shape under FakeTensorMode (shapes, dtypes and allocations as real, no
             memory and no arithmetic): the HF forward of one 64-token row, a log-softmax loss, backward, AdamW.
Writes <CASE>_rank<R>.json: the bytes of this rank's parameter shards, its gradients (before the step) and
its AdamW state (after it), each summed over the local tensors, the micro-batch's tokens, and the tracker's
peak with its breakdown."""

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
from flashdapo.distributed.mesh import init_distributed, shutdown
from flashdapo.models.parallelize import parallelize
from flashdapo.models.policy import PolicyModel
from flashdapo.plan.shapes import builtin_shape
from flashdapo.tasks.toy import build_toy_model
from flashdapo.trainer.batch import Group, build_train_batch
from flashdapo.trainer.collect.dealing import deal_to_slots
from flashdapo.trainer.update import update_actor

GROUPS, N, TOY_VOCAB = 2, 8, 289


def local_bytes(tensors) -> int:
    """Bytes of the local tensors (a DTensor's shard on this rank)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def build(case: str):
    """(config, HF model, the mode the run happens in)."""
    if case == "toy":
        cfg = merge(toy(), {"rollout": {"n": N}, "trainer": {"train_batch": GROUPS, "gen_batch": GROUPS,
                                                             "mini_batch": GROUPS, "micro_batch_tokens": 100000}})
        cfg = replace(cfg, model=replace(cfg.model, gradient_checkpointing=True))
        return cfg, build_toy_model(cfg.model, TOY_VOCAB, 4096, seed=0), nullcontext()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = replace(toy(), model=replace(toy().model, gradient_checkpointing=True))
    values = {k: v for k, v in builtin_shape("Qwen2.5-0.5B").items() if k not in ("architectures", "model_type")}
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **values), dtype=torch.float32,
                                              attn_implementation="sdpa")
    return cfg, hf, fake


def toy_batch(env):
    g = torch.Generator().manual_seed(7)
    groups = []
    for _ in range(GROUPS):
        prompt = torch.randint(3, TOY_VOCAB, (int(torch.randint(40, 80, (1,), generator=g)),), generator=g)
        responses = [torch.randint(3, TOY_VOCAB, (int(torch.randint(100, 300, (1,), generator=g)),), generator=g)
                     for _ in range(N)]
        acc = torch.arange(N) % 2 == 0
        groups.append(Group(prompt, responses, torch.where(acc, 1.0, -1.0), acc, torch.zeros(N, dtype=torch.bool),
                            origin=(1, 0, len(groups))))
    dealt = deal_to_slots(groups, GROUPS, env.world_size, env.rank, toy().algorithm.advantage_eps)
    return build_train_batch(dealt, None, toy().algorithm)


def run(case: str, env, out: Path) -> None:
    measured = {}
    cfg, hf, mode = build(case)

    def before_step(optimizer, *_):
        measured["grads"] = local_bytes(p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)

    def after_step(optimizer, *_):
        states = list(optimizer.state.values())
        measured["moments"] = local_bytes(s[k] for s in states for k in ("exp_avg", "exp_avg_sq"))
        measured["steps"] = local_bytes(s["step"] for s in states)

    with mode:
        policy = parallelize(PolicyModel(hf, "sdpa", cfg.trainer.kernel_impl, 1.0), env, cfg.model, cfg.trainer)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)  # as trainer/run.py builds it
        optimizer.register_step_pre_hook(before_step)
        optimizer.register_step_post_hook(after_step)
        measured["params"] = local_bytes(policy.parameters())
        tracker = FSDPMemTracker(policy, optimizer)
        with tracker:
            if case == "toy":
                batch = toy_batch(env)
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
    (out / f"{case}_rank{env.rank}.json").write_text(json.dumps(measured))


if __name__ == "__main__":
    environment = init_distributed("cpu")
    for name in sys.argv[2:]:
        run(name, environment, Path(sys.argv[1]))
    shutdown()

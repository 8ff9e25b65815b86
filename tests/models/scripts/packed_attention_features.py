"""torchrun script (sp = world size, 2 in the test): per-token log-probs and gradients of one packed micro-batch
under Ulysses sequence parallelism, for tiny float64 models whose attention the packed path has to compute with
explicit scores: GPT-OSS (attention sinks, each rank given its heads' ones) and Gemma 2 (attention softcap 0.5),
both with a sliding and a full layer. Next to them one process running each sequence alone with transformers'
eager attention (the reference every rank computes without collectives). argv: OUT_DIR. Rank 0 writes results.pt: per model,
"sp" and "alone", each (log-probs of the whole micro-batch, gradients of sum(weights * logp) summed over the
group)."""

import copy
import os
import sys

import torch
import torch.distributed as dist

from flashdapo.distributed.mesh import init_distributed, shutdown
from flashdapo.models.policy import PolicyModel
from tests.helpers.attention_models import VOCAB, gemma2_softcapped, gpt_oss_with_sinks

out = sys.argv[1]
env = init_distributed("cpu", sequence_parallel=int(os.environ["WORLD_SIZE"]))
g = torch.Generator().manual_seed(5)
LENGTHS = [(7, 14), (1, 1), (3, 9), (6, 5)]  # (prompt, response): the first spans the shards; 44 tokens
prompts = [torch.randint(0, VOCAB, (p,), generator=g) for p, _ in LENGTHS]
responses = [torch.randint(0, VOCAB, (r,), generator=g) for _, r in LENGTHS]
weights = torch.randn(sum(r for _, r in LENGTHS), generator=g, dtype=torch.float64)


def logprobs_and_grads(model, dist_env=None):
    """Log-probs of the whole micro-batch and the gradients of sum(weights * logp) (summed over the sp group);
    without `dist_env`, one process running each sequence alone (no padding: a padding query that sees no key
    in the window makes HF's float64 eager attention NaN, its softmax being fp32)."""
    policy = PolicyModel(model.train(), "eager", "naive", temperature=1.0)
    if dist_env is None:
        logp = torch.cat([policy(policy.token_batch([p], [r], torch.device("cpu")))[0]
                          for p, r in zip(prompts, responses)])
        (logp.double() * weights).sum().backward()
        return logp.detach().double(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    policy.set_layout(True, dist_env)
    batch = policy.token_batch(prompts, responses, torch.device("cpu"))
    logp, _ = policy(batch)
    (logp.double() * batch.local(weights)).sum().backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    for grad in grads.values():
        dist.all_reduce(grad, group=dist_env.sp_group)
    return policy.whole_micro_batch(logp.detach().double(), batch), grads


results = {}
for name, build in (("gpt_oss", gpt_oss_with_sinks), ("gemma2", lambda: gemma2_softcapped(0.5))):
    model = build()
    results[name] = {"alone": logprobs_and_grads(copy.deepcopy(model)), "sp": logprobs_and_grads(model, env)}
if env.is_main:
    torch.save(results, os.path.join(out, "results.pt"))
shutdown()

"""torchrun script: per-token log-probs and gradients of one packed micro-batch under sequence parallelism
over all the ranks torchrun starts (sp = world size), for attention shapes that the sp all-to-all has to
handle specially, next to one-process references every rank computes without collectives. argv: OUT_DIR.

Cases (tiny Qwen2 models, 2 layers):
- kv1: 4 query heads, 1 key/value head (fewer than sp: the KV head is repeated before the all-to-all), float64.
- window: sliding-window attention in layer 1 (window 6, shorter than most sequences), float64, SDPA.
- flash: both, bf16, attention by flash-attn's varlen function (the CPU stand-in, tests/trainer/flash_stand_in.py).
Rank 0 writes results.pt: per case, "sp" (the sp run's log-probs of the whole micro-batch and gradients summed
over ranks), "padded" (one process, padded rows, SDPA with HF's masks: the reference, in float64 from the
same weights) and, for bf16, "padded_bf16" (the same in bf16: the error bf16 itself brings)."""

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flash_stand_in  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from flashdapo.distributed.mesh import init_distributed, shutdown  # noqa: E402
from flashdapo.models.policy import PolicyModel  # noqa: E402

out = Path(sys.argv[1])
env = init_distributed("cpu", sequence_parallel=int(os.environ["WORLD_SIZE"]))
stand_in = flash_stand_in.install()
VOCAB = 61
CASES = {"kv1": dict(kv_heads=1, window=False, dtype=torch.float64, impl="sdpa"),
         "window": dict(kv_heads=2, window=True, dtype=torch.float64, impl="sdpa"),
         "flash": dict(kv_heads=1, window=True, dtype=torch.bfloat16, impl="flash_attention_2")}

g = torch.Generator().manual_seed(5)
LENGTHS = [(7, 40), (1, 1), (3, 9), (12, 20)]  # (prompt, response): the first response spans shards
prompts = [torch.randint(0, VOCAB, (p,), generator=g) for p, _ in LENGTHS]
responses = [torch.randint(0, VOCAB, (r,), generator=g) for _, r in LENGTHS]
weights = torch.randn(sum(r for _, r in LENGTHS), generator=g, dtype=torch.float64)


def build(kv_heads: int, window: bool, dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      use_sliding_window=window, sliding_window=6, max_window_layers=1)
    return Qwen2ForCausalLM(cfg).to(dtype).train()


def logprobs_and_grads(model, impl: str, dist_env=None):
    """Log-probs of the whole micro-batch and the gradients of sum(weights * logp) (summed over the sp group)."""
    model.config._attn_implementation = impl
    policy = PolicyModel(model, impl, "naive", temperature=0.7)
    if dist_env is not None:
        policy.set_layout(True, dist_env)
    batch = policy.token_batch(prompts, responses, torch.device("cpu"))
    logp, _ = policy(batch)
    (logp.double() * batch.local(weights)).sum().backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters()}
    if dist_env is not None:
        for grad in grads.values():
            dist.all_reduce(grad, group=dist_env.sp_group)
        logp = policy.whole_micro_batch(logp.detach().double(), batch)
    return logp.detach().double(), grads


results = {}
for name, case in CASES.items():
    model = build(case["kv_heads"], case["window"], case["dtype"])
    reference = copy.deepcopy(model).double()  # the same weights, exactly, in float64
    results[name] = {"padded": logprobs_and_grads(reference, "sdpa")}
    if case["dtype"] != torch.float64:
        results[name]["padded_bf16"] = logprobs_and_grads(copy.deepcopy(model), "sdpa")
    calls = len(stand_in.calls)
    results[name]["sp"] = logprobs_and_grads(model, case["impl"], env)
    results[name]["flash_calls"] = [c.window_size for c in stand_in.calls[calls:]]
if env.is_main:
    torch.save(results, out / "results.pt")
shutdown()

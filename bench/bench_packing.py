"""Padded vs packed micro-batches on CPU, in one process: forward + backward of the policy over the same
responses, planned by the trainer's own micro-batch planner under the same token budget.

    python -m bench.bench_packing [--sequences 32] [--budget 4096] [--repeats 3] [--threads 1]

Lengths follow DAPO's spread scaled down 10x for a CPU (prompts 10-30 tokens, responses log-uniform from 20
to 2048, the 20,480 cap / 10): most responses short, a few long. Padded rows cost rows x longest (SDPA with a
mask); packed rows cost their real tokens (SDPA per response inside the row, `flashdapo/trainer/packing.py`).
Prints the planned micro-batches, the tokens each layout computes, and the CPU seconds of this process
(time.process_time: on a shared machine other jobs' load barely moves it, where wall time swings by 5x)
for each layout in --repeats interleaved pairs, with the median padded/packed ratio. One torch thread by
default, for the same reason.
"""

from __future__ import annotations

import argparse
import math
import time
from types import SimpleNamespace

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashdapo.models.policy import PolicyModel
from flashdapo.trainer.batch import plan_micro_batches


def _lengths(count: int, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, 31, (count,), generator=g)
    responses = torch.exp(torch.empty(count).uniform_(math.log(20), math.log(2048), generator=g)).long()
    return list(zip(prompts.tolist(), responses.tolist()))


def _policy(pack: bool) -> PolicyModel:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    policy = PolicyModel(Qwen2ForCausalLM(config), "sdpa", "torch", temperature=1.0)
    policy.set_layout(pack, SimpleNamespace(sequence_parallel=1, sp_group=None, sp_rank=0))
    return policy


def _one_pass(policy: PolicyModel, prompts, responses, bins) -> float:
    start = time.process_time()
    for indices in bins:
        batch = policy.token_batch([prompts[i] for i in indices], [responses[i] for i in indices], torch.device("cpu"))
        logp, _ = policy(batch)
        logp.sum().backward()
    policy.zero_grad(set_to_none=True)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = _lengths(args.sequences, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 2048, (p,), generator=g) for p, _ in lengths]
    responses = [torch.randint(0, 2048, (r,), generator=g) for _, r in lengths]
    counts = [p + r - 1 for p, r in lengths]
    print(f"{len(lengths)} sequences, {sum(counts)} tokens, lengths {min(counts)}..{max(counts)} "
          f"(median {sorted(counts)[len(counts) // 2]}); budget {args.budget} tokens per micro-batch")
    layouts = {}
    for name, pack in (("padded", False), ("packed", True)):
        bins = [b for b in plan_micro_batches(counts, args.budget, padded=not pack) if b]
        computed = sum(sum(counts[i] for i in b) if pack else len(b) * max(counts[i] for i in b) for b in bins)
        layouts[name] = _policy(pack), bins
        print(f"{name}: {len(bins)} micro-batches, {computed} tokens computed")
    # Interleaved pairs: on a shared machine both layouts of a pair see about the same load.
    ratios = []
    for r in range(args.repeats):
        padded, packed = (_one_pass(policy, prompts, responses, bins) for policy, bins in layouts.values())
        ratios.append(padded / packed)
        print(f"pair {r + 1}: padded {padded:.2f} s, packed {packed:.2f} s of CPU (forward + backward), ratio {ratios[-1]:.2f}x")
    print(f"padded / packed time, median of {args.repeats} pairs: {sorted(ratios)[len(ratios) // 2]:.2f}x")

if __name__ == "__main__":
    main()

"""Padded vs packed micro-batches on CPU, in one process: forward + backward of the policy over the same
responses, planned by the trainer's own micro-batch planner under the same token budget.

    python -m bench.bench_packing [--sequences 32] [--budget 4096] [--repeats 3]

Lengths follow DAPO's spread scaled down 10x for a CPU (prompts 10-30 tokens, responses log-uniform from 20
to 2048, the 20,480 cap / 10): most responses short, a few long. Padded rows cost rows x longest (SDPA with a
mask); packed rows cost their real tokens (SDPA per response inside the row, `flashdapo/trainer/packing.py`).
Prints the planned micro-batches, the tokens each layout computes, and the seconds of each (best of
--repeats), with the padded/packed ratio.
"""

from __future__ import annotations

import argparse
import math
import time
from types import SimpleNamespace

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashdapo.trainer.batch import plan_micro_batches
from flashdapo.trainer.policy import PolicyModel


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
    start = time.perf_counter()
    for indices in bins:
        batch = policy.token_batch([prompts[i] for i in indices], [responses[i] for i in indices], torch.device("cpu"))
        logp, _ = policy(batch)
        logp.sum().backward()
    policy.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths = _lengths(args.sequences, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 2048, (p,), generator=g) for p, _ in lengths]
    responses = [torch.randint(0, 2048, (r,), generator=g) for _, r in lengths]
    counts = [p + r - 1 for p, r in lengths]
    print(f"{len(lengths)} sequences, {sum(counts)} tokens, lengths {min(counts)}..{max(counts)} "
          f"(median {sorted(counts)[len(counts) // 2]}); budget {args.budget} tokens per micro-batch")
    seconds = {}
    for name, pack in (("padded", False), ("packed", True)):
        policy = _policy(pack)
        bins = [b for b in plan_micro_batches(counts, args.budget, padded=not pack) if b]
        computed = sum(len(b) * max(counts[i] for i in b) if not pack else sum(counts[i] for i in b) for b in bins)
        seconds[name] = min(_one_pass(policy, prompts, responses, bins) for _ in range(args.repeats))
        print(f"{name}: {len(bins)} micro-batches, {computed} tokens computed, {seconds[name]:.2f} s "
              f"(forward + backward, best of {args.repeats})")
    print(f"padded / packed time: {seconds['padded'] / seconds['packed']:.2f}x")


if __name__ == "__main__":
    main()

"""Where the torch engine's generation time goes: torch.profiler over one `generate` on a step workload.

    python -m bench.profile_generation [--workload W2] [--tokens 16] [--threads 1] [--rows 20]

Builds the workload's random-init model (as bench/bench_step.py does), warms up with one generate, then
profiles one generate and prints the operators by self CPU time. Figures under the profiler are inflated
by its own overhead per operator: read them as shares, not as absolute times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from bench.bench_step import WORKLOADS, make_workload_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="W2", choices=sorted(WORKLOADS))
    parser.add_argument("--tokens", type=int, default=16, help="max new tokens (fewer than the workload's)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--rows", type=int, default=20, help="operators listed")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from flashdapo.rollout.base import SamplingParams
    from flashdapo.rollout.torch_engine import TorchEngine

    w = dataclasses.replace(WORKLOADS[args.workload], max_new_tokens=args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        root = make_workload_dir(w, Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, local_files_only=True)
        prompts = json.loads((root / "prompts.json").read_text())["ids"]
    engine = TorchEngine(model, eos_token_ids=[model.config.eos_token_id], pad_token_id=model.config.pad_token_id,
                         device="cpu")
    sampling = SamplingParams(n=w.n, max_new_tokens=w.max_new_tokens, seed=0)
    engine.generate(prompts, sampling)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.generate(prompts, sampling)
    print(f"{args.workload}: {w.completions} rows x {w.max_new_tokens} tokens, {torch.get_num_threads()} threads")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()

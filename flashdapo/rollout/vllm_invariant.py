"""trainer.batch_invariant with the co-located vLLM engine: vLLM in its batch-invariant mode, and the sampled
token's log-prob from flashdapo's LM-head kernel (docs/algorithm.md, "Exact on-policy").

Written against vLLM 0.32's sources; **the CUDA path is not yet run on a GPU** (tests/rollout/
test_exact_on_policy_vllm.py settles it). What the engine changes:

- **Batch-invariant mode.** `VLLM_BATCH_INVARIANT=1` before the engine starts: vLLM then calls, in every
  layer, kernels whose result for a row does not depend on the batch (`model_executor/determinism/
  batch_invariant.py`: persistent Triton GEMMs with a K-tile fixed per weight shape, norms one row per
  program, flash-attention without split-KV). The mode is process-wide: the trainer in the same process calls
  the same kernels through models/vllm_matching.py.
- **Eager, every custom op on** (`enforce_eager`, `compilation_config.custom_ops=["all"]`): no torch.compile
  fusing elementwise ops into other roundings, no CUDA graphs; each op is the kernel the trainer also calls.
  The cost is decode speed.
- **Flash-attention** (`attention_backend="FLASH_ATTN"`): the backend the trainer's attention matches.
- **The LM head in the model dtype** (no fp32 head override): the kernel below reads the head's weights.
- **The sampled token's log-prob** (`install_kernel_logprobs`, on the worker): vLLM's model runner calls
  `model.compute_logits(hidden)` on the rows it samples, then `sampler(logits, ...)`, whose
  `logprobs_tensors.logprobs[:, 0]` is the sampled token's log-prob (`v1/sample/sampler.py`). The hook keeps
  the hidden rows of the last `compute_logits` and overwrites that column with `token_logprobs(hidden,
  lm_head, sampled, temperature, invariant=True)`: the kernel the trainer's old-log-prob pass and fused
  update call, on the same hidden bits. Sampling itself is vLLM's, untouched.

Not covered (refused by config/tree.py's batch_invariant_gap): tensor parallelism (the head would be a vocab
shard), top-p/top-k (renormalized log-probs).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..kernels import token_logprobs

ENGINE_ENV = {"VLLM_BATCH_INVARIANT": "1"}
"""Set before the engine starts (vLLM reads it at start, `init_batch_invariance`)."""

ENGINE_KWARGS = {"enforce_eager": True, "compilation_config": {"custom_ops": ["all"]},
                 "attention_backend": "FLASH_ATTN"}
"""`vllm.LLM` arguments of the batch-invariant engine on CUDA (module docstring)."""

LogprobFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(hidden [N, H], head weight [V, H], sampled [N], temperature) -> log-probs [N] fp32."""


def kernel_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    """The sampled tokens' log-probs by flashdapo's batch-invariant LM-head kernel (the trainer's)."""
    return token_logprobs(hidden.to(weight.dtype), weight, tokens, temperature=temperature, invariant=True)


def engine_setup() -> dict[str, Any]:
    """Put vLLM's batch-invariant mode (CUDA) into this process's environment; the `vllm.LLM` arguments it
    needs."""
    os.environ.update(ENGINE_ENV)
    return dict(ENGINE_KWARGS)


def install_kernel_logprobs(worker: Any, dtype: torch.dtype | None = None,
                            logprob_fn: LogprobFn = kernel_logprobs) -> None:
    """On vLLM's worker (`LLM.collective_rpc`): from now on the sampled token's log-prob is
    `logprob_fn(hidden, lm_head, sampled, temperature)` (module docstring). `dtype`: the weights' compute
    dtype the trainer uses (None: the head's own)."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    head = model.lm_head
    vocab = int(getattr(head, "org_vocab_size", None) or head.weight.shape[0])  # vLLM pads the head's rows
    kept: dict[str, torch.Tensor | None] = {"hidden": None}
    compute_logits = model.compute_logits

    def compute_logits_keeping_rows(hidden_states, *args, **kwargs):
        kept["hidden"] = hidden_states
        return compute_logits(hidden_states, *args, **kwargs)

    sampler = runner.sampler
    sample = sampler.forward

    def sample_with_kernel_logprobs(logits, sampling_metadata, *args, **kwargs):
        out = sample(logits, sampling_metadata, *args, **kwargs)
        hidden, kept["hidden"] = kept["hidden"], None
        lp = out.logprobs_tensors
        if lp is None or lp.logprobs.numel() == 0:
            return out
        if hidden is None or hidden.shape[0] != lp.logprobs.shape[0]:
            seen = None if hidden is None else hidden.shape[0]
            raise RuntimeError(f"trainer.batch_invariant: vLLM sampled {lp.logprobs.shape[0]} rows but the "
                               f"last compute_logits saw {seen}: the sampled log-probs cannot be the "
                               "kernel's")
        weight = head.weight[:vocab]
        weight = weight.to(dtype) if dtype is not None else weight
        lp.logprobs[:, 0] = logprob_fn(hidden, weight, out.sampled_token_ids[:, 0].long(),
                                       _temperature(sampling_metadata)).to(lp.logprobs.dtype)
        return out

    model.compute_logits = compute_logits_keeping_rows
    sampler.forward = sample_with_kernel_logprobs


def _temperature(sampling_metadata: Any) -> float:
    """The one temperature of a step's rows (flashdapo samples every row of a call at the same one)."""
    temperature = getattr(sampling_metadata, "temperature", None)
    if temperature is None:  # all greedy
        raise RuntimeError("trainer.batch_invariant: greedy rows have no sampled log-prob to match")
    low, high = torch.stack([temperature.min(), temperature.max()]).tolist()  # one host sync a step
    if low != high:
        raise RuntimeError(f"trainer.batch_invariant: one vLLM step samples at temperatures {low} to {high}")
    return low


__all__ = ["ENGINE_ENV", "ENGINE_KWARGS", "engine_setup", "install_kernel_logprobs", "kernel_logprobs"]

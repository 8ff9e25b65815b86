"""The naive reference: materialize `[tokens, vocab]` logits in fp32, log-softmax, gather.

Every faster implementation is tested against this path (and this path against float64), and the
benchmarks use it as the memory/time baseline. It costs 4*N*V bytes of logits plus as much again for
their gradient, which is exactly what the fused paths exist to avoid.
"""

from __future__ import annotations

import torch

from .softcap import normalize_softcap


def _logits(hidden, weight, temperature, softcap):
    """(c tanh(h W^T / c) or h W^T) / T in fp32 (float64 for float64 inputs): HF's order, cap then T."""
    compute_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).T
    cap = normalize_softcap(softcap)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    return logits / temperature


def naive_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) and optionally entropy, through materialized fp32 logits.

    hidden [N, H], weight [V, H], targets [N] int -> logp [N] fp32 (and entropy [N] fp32).
    Computes in float64 when the inputs are float64 (the test reference), fp32 otherwise. `softcap` c
    (None or 0: off): the logits are c tanh(h W^T / c) before the division by the temperature, as HF's
    Gemma 2/3/4 and vLLM compute them (the derivative through autograd).
    """
    logits = _logits(hidden, weight, temperature, softcap)
    logprobs_all = torch.log_softmax(logits, dim=-1)
    logp = logprobs_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    return logp, entropy


@torch.no_grad()
def naive_token_probe_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            temperature: float = 1.0, softcap: float | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """No-grad (logp, entropy, top-1 probability max_v p_v) per token [N], through materialized logits."""
    logits = _logits(hidden, weight, temperature, softcap)
    logprobs_all = torch.log_softmax(logits, dim=-1)
    logp = logprobs_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    return logp, entropy, logprobs_all.amax(-1).exp()

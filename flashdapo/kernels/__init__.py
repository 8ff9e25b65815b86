"""LM head -> per-token log-prob / entropy, without `[tokens, vocab]` logits.

A leaf package: it imports nothing else from flashdapo, and knows no loss. A loss (the DAPO token
loss of `flashdapo.algorithm`) is composed on the returned log-probs; its gradient reaches the
kernels' backward as a per-token upstream gradient, and rows where that gradient is exactly zero
(masked and clipped tokens) are skipped there. Three implementations share one contract:

- `naive`:  materialized fp32 logits (the reference and the benchmark baseline);
- `torch`:  chunked over tokens/vocab with a custom autograd.Function that saves per-token statistics
            and recomputes logits in backward (any device; the CPU default);
- `triton`: fused forward/backward kernels (the CUDA default; runs under TRITON_INTERPRET=1 on CPU).

`impl="auto"` picks triton on CUDA and torch elsewhere.
"""

from __future__ import annotations

from typing import Literal

import torch

from .naive import naive_token_logprobs

Impl = Literal["auto", "naive", "torch", "triton"]
IMPLS: tuple[str, ...] = ("auto", "naive", "torch", "triton")

__all__ = ["IMPLS", "Impl", "resolve_impl", "token_logprobs"]


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map `auto` to the implementation for `device`; reject unknown names."""
    if impl not in IMPLS:
        raise ValueError(f"kernel impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return impl


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected targets [N={hidden.shape[0]}], got {tuple(targets.shape)}")


def _logprobs(hidden, weight, targets, temperature, with_entropy, impl):
    _check_inputs(hidden, weight, targets)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    impl = resolve_impl(impl, hidden.device)
    if impl == "naive":
        return naive_token_logprobs(hidden, weight, targets, temperature, with_entropy)
    if impl == "torch":
        from .chunked import chunked_token_logprobs

        return chunked_token_logprobs(hidden, weight, targets, temperature, with_entropy)
    from .triton_logprobs import triton_token_logprobs

    return triton_token_logprobs(hidden, weight, targets, temperature, with_entropy)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[target] per token, fp32, never materializing logits.

    hidden [N, H] (packed tokens), weight [V, H] (the LM head), targets [N] -> logp [N] fp32, and
    entropy [N] fp32 when `with_entropy`. Differentiable w.r.t. `hidden` and `weight`.
    """
    logp, entropy = _logprobs(hidden, weight, targets, temperature, with_entropy, impl)
    return (logp, entropy) if with_entropy else logp


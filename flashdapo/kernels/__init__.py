"""LM head -> per-token log-prob / entropy, without `[tokens, vocab]` logits.

A leaf package: it imports nothing else from flashdapo, and knows no loss. A loss (the DAPO token
loss of `flashdapo.algorithm`) is composed on the returned log-probs; its gradient reaches the
kernels' backward as a per-token upstream gradient, and rows where that gradient is exactly zero
(masked and clipped tokens) are skipped there. Implementations (`KernelImpl`, the one registry of
their names, read by flashdapo.config, the tests and the benchmarks) share one contract:

- `naive`:  materialized fp32 logits (the reference and the benchmark baseline);
- `torch`:  the chunked driver (library matmuls, logits recomputed in backward) with its elementwise
            passes as torch ops (any device; the CPU default);
- `triton`: the same driver with its elementwise passes as Triton kernels (the CUDA default; runs
            under TRITON_INTERPRET=1 on CPU).

`impl="auto"` picks triton on CUDA and torch elsewhere. Every entry point takes `softcap` (a model's
final-logit softcapping, Gemma's `final_logit_softcapping`; None or 0: off, the default): the logits are
then c tanh(h W^T / c) / temperature, in every impl and pass. Math and design: docs/kernels.md.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from .naive import naive_token_logprobs
from .softcap import normalize_softcap

KernelImpl = Literal["auto", "naive", "torch", "triton"]
IMPLS: tuple[str, ...] = get_args(KernelImpl)
CHUNKED_IMPLS: tuple[str, ...] = ("torch", "triton")
"""The impls run by the chunked driver (what the kernel tests and benchmarks compare to naive)."""

__all__ = ["CHUNKED_IMPLS", "IMPLS", "KernelImpl", "fused_loss_default", "fused_token_loss", "resolve_impl",
           "token_logprobs", "token_probe_stats"]


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


def _logprobs(hidden, weight, targets, temperature, with_entropy, impl, softcap, invariant=False):
    _check_inputs(hidden, weight, targets)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    softcap = normalize_softcap(softcap)
    impl = resolve_impl(impl, hidden.device)
    if impl == "naive":
        if invariant:
            raise ValueError("invariant log-probs run the chunked impls (torch, triton), not naive")
        return naive_token_logprobs(hidden, weight, targets, temperature, with_entropy, softcap)
    from .chunked import chunked_token_logprobs

    return chunked_token_logprobs(hidden, weight, targets, temperature, with_entropy, impl=impl,
                                  softcap=softcap, invariant=invariant)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    impl: str = "auto",
    softcap: float | None = None,
    invariant: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[target] per token, fp32, never materializing logits.

    hidden [N, H] (packed tokens), weight [V, H] (the LM head), targets [N] -> logp [N] fp32, and
    entropy [N] fp32 when `with_entropy`. Differentiable w.r.t. `hidden` and `weight`. `softcap` c: the
    model's final-logit softcapping (HF `final_logit_softcapping`; None or 0: off), logits
    c tanh(hidden @ weight.T / c) / temperature: the cap first, then the sampler's temperature.
    `invariant`: a row's results are the same bits whatever other rows the call holds, and equal to
    `fused_token_loss(..., invariant=True)`'s (the chunked impls; kernels/invariant.py).
    """
    logp, entropy = _logprobs(hidden, weight, targets, temperature, with_entropy, impl, softcap, invariant)
    return (logp, entropy) if with_entropy else logp


def token_probe_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    impl: str = "auto",
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, top-1 probability) per token [N] fp32, no gradient: what a probe of the policy reads.

    The chunked impls take the top-1 probability from the forward's running statistics (1 / s, with s the
    sum of exp(z/T - max)), never materializing logits; naive from its materialized softmax. `softcap`: as
    in `token_logprobs`."""
    _check_inputs(hidden, weight, targets)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    softcap = normalize_softcap(softcap)
    impl = resolve_impl(impl, hidden.device)
    if impl == "naive":
        from .naive import naive_token_probe_stats

        return naive_token_probe_stats(hidden, weight, targets, temperature, softcap)
    from .chunked import chunked_token_probe_stats

    return chunked_token_probe_stats(hidden, weight, targets, temperature, impl=impl, softcap=softcap)


def fused_loss_default(impl: str, device: torch.device) -> bool:
    """Whether a training loss should run through `fused_token_loss` rather than token_logprobs + loss,
    without knowing the GPU: the fused sweep (6 NHV) on a CPU, where it is measured faster
    (bench/results/NOTES.md); the generic path on CUDA. The trainer picks per GPU from the cost model
    (kernels/lm_head_choice.py) and falls back to this for a GPU the model does not know. naive has no fused
    form.
    """
    return device.type != "cuda" and resolve_impl(impl, device) in CHUNKED_IMPLS


def fused_token_loss(hidden, weight, targets, loss_fn, *, keep=None, temperature: float = 1.0,
                     impl: str = "auto", softcap: float | None = None, invariant: bool = False):
    """`flashdapo.kernels.fused.fused_token_loss` with `impl` resolved ("auto": triton on CUDA, torch
    elsewhere; naive is refused) and the inputs checked as token_logprobs checks them (`softcap` too)."""
    from .fused import fused_token_loss as fused

    _check_inputs(hidden, weight, targets)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    softcap = normalize_softcap(softcap)
    impl = resolve_impl(impl, hidden.device)
    if impl not in CHUNKED_IMPLS:
        raise ValueError(f"fused_token_loss runs the chunked impls {CHUNKED_IMPLS}, got {impl!r}")
    return fused(hidden, weight, targets, loss_fn, keep=keep, temperature=temperature, impl=impl,
                 softcap=softcap, invariant=invariant)

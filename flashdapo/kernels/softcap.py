"""Final-logit softcapping (Gemma 2, Gemma 3 with a cap, Gemma 4: `final_logit_softcapping` in the HF config).

The model's logits are x' = c tanh(x / c) with x = h W^T the LM head's product and c the cap; the sampler
then divides by its temperature T, so every kernel sees z = c tanh(x / c) / T: cap first, temperature
second, as transformers' Gemma2ForCausalLM.forward (the cap inside the model), HF generation's
TemperatureLogitsWarper and vLLM (LogitsProcessor(soft_cap=...) inside the model, the sampler's division
after it) do. Its derivative dz/dx = sech^2(x / c) / T = (1 - tanh^2(x / c)) / T; the 1/T is folded into the
upstream gradients, as without a cap, and each dz tile is multiplied by sech^2(x / c) per logit.

sech^2 is computed without the cancellation of 1 - t^2 (which is 0 in fp32 once |x / c| > ~9 and loses
every digit below ~1e-7): torch as cosh(a)^-2, the Triton passes as 4 q / (1 + q)^2 with q = exp(-2|a|).
docs/kernels.md ("Final-logit softcapping") has the math of every pass.
"""

from __future__ import annotations

import math

import torch


def normalize_softcap(softcap: float | None) -> float | None:
    """The cap as a positive finite float, or None when off (None or 0, as HF configs spell "no cap")."""
    if softcap is None:
        return None
    cap = float(softcap)
    if cap == 0.0:
        return None
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be None, 0 (off) or a positive finite float, got {softcap!r}")
    return cap


def cap_(x: torch.Tensor, softcap: float, temperature: float,
         deriv: torch.Tensor | None = None) -> torch.Tensor:
    """x (raw logits, overwritten) -> c tanh(x / c) / T in place, returned; with `deriv` (a tensor of x's
    shape), sech^2(x / c) written there first (cosh(a)^-2: relative accuracy also where tanh saturates;
    cosh overflows to inf beyond |a| ~ 89 in fp32, giving 0 where the true value is below 1e-77)."""
    a = x.div_(softcap)
    if deriv is not None:
        torch.cosh(a, out=deriv).pow_(-2)
    return a.tanh_().mul_(softcap / temperature)


__all__ = ["cap_", "normalize_softcap"]

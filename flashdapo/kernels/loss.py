"""The DAPO token-level surrogate on per-token log-probs (DAPO.md section 1), shared by every impl.

This part is elementwise over N tokens and costs nothing next to the LM head; what matters for speed is
that its gradient dL/dlogp is exactly zero on masked and clipped tokens, which the fused log-prob
kernels use to skip those rows' backward work entirely.

    r   = exp(logp - old)                       (log-ratio clamped to +-20 as in verl, to keep r finite)
    l   = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))         Clip-Higher: eps_low != eps_high
    l   = min(l, -A c)  where A < 0, when clip_ratio_c is set      dual clip (released recipe, c = 10)
    L   = sum(mask * l) / normalizer                                token-level mean, global normalizer
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

LOG_RATIO_CLAMP = 20.0


@dataclass
class LossStats:
    """Detached token sums of one loss call; add them across micro-batches and ranks, then take `means`.

    Sums rather than means so that a reduction over micro-batches and data-parallel ranks is exact.
    """

    num_tokens: torch.Tensor
    """Valid (mask=1) response tokens."""
    pg_clipfrac: torch.Tensor
    """Tokens where the clipped branch is active (either side), as in verl's `pg_clipfrac`."""
    pg_clipfrac_lower: torch.Tensor
    """Tokens where the dual clip (A < 0, r > c) is active, as in verl's `pg_clipfrac_lower`."""
    ppo_kl: torch.Tensor
    """Sum of (logp_old - logp_new): verl's `ppo_kl` estimator."""
    entropy: torch.Tensor
    """Sum of per-token entropies (fp32)."""
    token_prob: torch.Tensor
    """Sum of exp(logp_new): the paper's mean token probability once divided by num_tokens."""
    ratio: torch.Tensor
    """Sum of importance ratios r."""

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_vector(self) -> torch.Tensor:
        """All sums in one fp64 vector, for a single all-reduce."""
        return torch.stack([getattr(self, f.name).double().reshape(()) for f in fields(self)])

    @classmethod
    def from_vector(cls, vector: torch.Tensor) -> LossStats:
        return cls(*vector.unbind(0))

    @classmethod
    def zeros(cls, device: torch.device | str = "cpu") -> LossStats:
        """All sums zero (fp64), e.g. to start an accumulation."""
        return cls.from_vector(torch.zeros(len(fields(cls)), dtype=torch.float64, device=device))

    def means(self) -> dict[str, float]:
        """Per-token means of every statistic (0 when there are no tokens)."""
        count = max(float(self.num_tokens), 1.0)
        return {f.name: float(getattr(self, f.name)) / count for f in fields(self) if f.name != "num_tokens"}


def dapo_token_loss(
    logp: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None,
    normalizer: torch.Tensor | float | None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Scalar DAPO loss from per-token log-probs (differentiable in `logp`) and detached token sums.

    `normalizer` is the global number of valid tokens of the mini-batch (all micro-batches, all ranks);
    None uses this call's own count. A fully masked input gives loss 0 and zero gradient, never NaN.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None to disable), got {clip_ratio_c}")
    dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
    logp = logp.to(dtype)
    old = old_logprobs.to(dtype)
    adv = advantages.to(dtype)
    valid = mask.to(dtype)

    log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    dual_clipped = torch.zeros_like(clipped)
    if clip_ratio_c is not None:
        loss_dual = -adv * clip_ratio_c
        dual_clipped = (adv < 0) & (per_token > loss_dual)
        per_token = torch.where(dual_clipped, loss_dual, per_token)

    if normalizer is None:
        normalizer = valid.sum()
    normalizer = torch.as_tensor(normalizer, dtype=dtype, device=logp.device).clamp_min(1.0)
    # where(), not multiply: a masked token's value must not leak a NaN/inf into the sum or gradient.
    loss = torch.where(valid > 0, per_token, torch.zeros_like(per_token)).sum() / normalizer

    with torch.no_grad():
        new = logp.detach()
        stats = LossStats(
            num_tokens=valid.sum(),
            pg_clipfrac=((clipped | dual_clipped).to(dtype) * valid).sum(),
            pg_clipfrac_lower=(dual_clipped.to(dtype) * valid).sum(),
            ppo_kl=((old - new) * valid).sum(),
            entropy=(entropy.detach().to(dtype) * valid).sum() if entropy is not None else valid.new_zeros(()),
            token_prob=(new.exp() * valid).sum(),
            ratio=(ratio.detach() * valid).sum(),
        )
    return loss.to(torch.float32) if dtype == torch.float32 else loss, stats

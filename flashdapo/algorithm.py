"""DAPO's math on tensors: no I/O, no model (DAPO.md sections 1-3).

The choices, as the paper and the released recipe make them:

- Reward = rule-based correctness (+1 / -1) PLUS the soft overlong punishment: 0 up to
  L_max - L_cache tokens, then a linear ramp down to -1 at L_max, -1 beyond, times a factor.
  A truncated wrong answer therefore scores -2.
- Advantage = (R - group mean) / (group std + eps) with the UNBIASED std (n - 1), shared by every
  token of the response. A group of one response has mean 0 and std 1, so A = R.
- Dynamic sampling keeps a group iff the std of its `acc` (correct/incorrect, not the shaped score)
  is > 0; all-correct and all-wrong groups carry no gradient. A group of one response is kept.
- Token-level loss: the per-token clipped surrogate (Clip-Higher eps_low=0.2, eps_high=0.28, dual
  clip c=10 for A<0; `flashdapo.kernels.loss`) summed over every valid response token of a
  mini-batch and divided by the number of those tokens over ALL micro-batches and ALL data-parallel
  ranks (`global_token_count`). Not a per-sequence mean, not a per-micro-batch mean.
- No KL term, no reference model, no entropy bonus.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment per response, in [-factor, 0] (fp32).

    0 if L <= max_len - buffer_len; ((max_len - buffer_len) - L) / buffer_len * factor within the
    buffer; -factor if L > max_len.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    expected = max_len - buffer_len
    lengths = lengths.to(torch.float32)
    ramp = (expected - lengths) / buffer_len
    penalty = torch.where(lengths <= expected, torch.zeros_like(ramp), ramp)
    penalty = torch.where(lengths > max_len, torch.full_like(ramp, -1.0), penalty)
    return penalty * factor


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group index 0..G-1 for arbitrary group ids, and G."""
    _, dense = torch.unique(group_ids, return_inverse=True)
    return dense, int(dense.max()) + 1 if dense.numel() else 0


def group_mean_std(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response group mean, unbiased group std, and group size (broadcast back to responses)."""
    dense, num_groups = _group_index(group_ids)
    values = values.to(torch.float64)
    size = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, dense, torch.ones_like(values))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, dense, values)
    mean = total / size
    sq_dev = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, dense, (values - mean[dense]) ** 2)
    std = torch.sqrt(sq_dev / (size - 1).clamp_min(1.0))
    return mean[dense], std[dense], size[dense]


def group_advantages(scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(score - group mean) / (unbiased group std + eps) per response (fp32); size-1 groups get A = score."""
    mean, std, size = group_mean_std(scores, group_ids)
    singleton = size == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    return ((scores.to(torch.float64) - mean) / (std + eps)).to(torch.float32)


def informative_groups(acc: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per-response keep mask of dynamic sampling: the group's accuracies are not all equal (or size 1)."""
    _, std, size = group_mean_std(acc.to(torch.float64), group_ids)
    return (std > 0) | (size == 1)


def global_token_count(mask: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The token-mean normalizer: valid tokens of a whole mini-batch summed over data-parallel ranks.

    `mask` holds this rank's valid-token flags of the mini-batch (all its micro-batches). One
    all-reduce per mini-batch; without an initialized process group, the local count.
    """
    count = mask.sum().to(torch.float64).reshape(1)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        device = count.device
        if dist.get_backend(group) == "nccl" and device.type != "cuda":
            count = count.cuda()
        dist.all_reduce(count, group=group)
        count = count.to(device)
    return count[0]

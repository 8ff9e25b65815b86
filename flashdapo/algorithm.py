"""DAPO's math on tensors: rewards, advantages, the group filter, the token loss and its normalizer.

No I/O and no model: every function here takes and returns tensors (docs/algorithm.md has the
derivations). The choices, as the paper and the released recipe make them:

- Reward = rule-based correctness (+1 / -1) PLUS the soft overlong punishment: 0 up to
  L_max - L_cache tokens, then a linear ramp down to -1 at L_max, -1 beyond, times a factor.
  A truncated wrong answer therefore scores -2 (`shaped_scores`).
- Advantage = (R - group mean) / (group std + eps) with the UNBIASED std (n - 1), shared by every
  token of the response. A group of one response has mean 0 and std 1, so A = R (`group_advantages`).
- Dynamic sampling keeps a group iff the std of its `acc` (correct/incorrect, not the shaped score;
  `algorithm.filter_metric=score` for non-binary rewards) is > 0; all-correct and all-wrong groups carry no
  gradient. A group of one response is kept (`informative_groups`). Overlong filtering (an ablation, off by
  default) masks truncated responses out of the loss (`response_loss_mask`).
- Token-level loss (`token_loss`): the per-token clipped surrogate

      r = exp(logp - old)                     (log-ratio clamped to +-20 as in verl, to keep r finite)
      l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))        Clip-Higher: eps_low=0.2, eps_high=0.28
      l = min(l, -A c)  where A < 0, when clip_ratio_c is set     dual clip (released recipe, c = 10)

  summed over every valid response token of a mini-batch and divided by the number of those tokens
  over ALL micro-batches and ALL data-parallel ranks (`loss_normalizers` of the whole mini-batch's counts;
  trainer/batch.py gathers them). Not a per-sequence
  mean, not a per-micro-batch mean; those are the other `algorithm.loss_agg_mode`s (`loss_normalizers`),
  each defined on the whole mini-batch so that ranks and micro-batches never change the gradient.
- Rollout correction (`rollout_correction_weights`): a detached per-token factor on the loss from the
  ratio pi_old / pi_rollout of the trainer's and the engine's log-probs (truncated or masked, per token
  or per response); masked tokens leave the loss and its normalizer.
- The loss's gradient dL/dlogp is exactly zero on masked and clipped tokens; the log-prob kernels
  (`flashdapo.kernels`) skip those rows' backward work.
- No KL term, no reference model, no entropy bonus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from .config import AlgorithmConfig, engine_spec

LOG_RATIO_CLAMP = 20.0


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int,
                     factor: float = 1.0) -> torch.Tensor:
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


def shaped_scores(correctness: torch.Tensor, lengths: torch.Tensor, max_len: int,
                  algo: AlgorithmConfig) -> torch.Tensor:
    """The reward per response (fp32): the verifier's score plus, when enabled, the overlong penalty."""
    scores = correctness.to(torch.float32)
    if algo.overlong_buffer:
        scores = scores + overlong_penalty(lengths, max_len, algo.overlong_buffer_len,
                                           algo.overlong_penalty_factor)
    return scores


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group index 0..G-1 for arbitrary group ids, and G."""
    _, dense = torch.unique(group_ids, return_inverse=True)
    return dense, int(dense.max()) + 1 if dense.numel() else 0


def group_mean_std(values: torch.Tensor,
                   group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def informative_groups(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per-response keep mask of dynamic sampling: the group's filter values (`acc`, or the shaped score with
    algorithm.filter_metric=score) are not all equal, i.e. their std is > 0 (or the group has size 1)."""
    _, std, size = group_mean_std(values.to(torch.float64), group_ids)
    return (std > 0) | (size == 1)


def response_loss_mask(truncated: torch.Tensor, algo: AlgorithmConfig) -> torch.Tensor:
    """[B] bool: the response's tokens enter the loss (overlong filtering drops truncated responses)."""
    return ~truncated.bool() if algo.overlong_filter else torch.ones(truncated.shape, dtype=torch.bool)


def loss_normalizers(valid_tokens: torch.Tensor, mode: str, micro_batch: int) -> torch.Tensor:
    """Per response of a whole mini-batch, the divisor of each of its tokens' losses [B] (fp64).

    `valid_tokens` [B] counts each response's valid tokens, for the mini-batch's responses in order over
    all ranks. With S the responses that have a valid token, N the valid tokens, and the mini-batch cut into
    consecutive chunks of `micro_batch` responses (chunk m: S_m such responses, N_m valid tokens):
    token-mean -> N; seq-mean-token-mean -> S * n_s; seq-mean-token-sum -> S;
    token-mean-per-micro-batch -> N_m * S / S_m, i.e. the loss sum_m (S_m / S) * (chunk m's token mean).
    The divisors depend on the mini-batch alone, never on how ranks or micro-batches split it. Responses
    without a valid token get 1 (their tokens are masked anyway).
    """
    n = valid_tokens.to(torch.float64)
    contributing = (n > 0).to(torch.float64)
    count = contributing.sum()
    if mode == "token-mean":
        out = n.sum().expand(n.shape)
    elif mode == "seq-mean-token-mean":
        out = count * n
    elif mode == "seq-mean-token-sum":
        out = count.expand(n.shape)
    elif mode == "token-mean-per-micro-batch":
        chunk = torch.arange(len(n)) // micro_batch
        chunks = int(chunk.max()) + 1 if len(n) else 0
        tokens = torch.zeros(chunks, dtype=torch.float64).index_add_(0, chunk, n)
        responses = torch.zeros(chunks, dtype=torch.float64).index_add_(0, chunk, contributing)
        out = (tokens * count / responses.clamp_min(1.0))[chunk]
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}")
    return torch.where(n > 0, out, torch.ones_like(out))


def resolved_rollout_correction(algo: AlgorithmConfig, off_policy: bool) -> str:
    """algorithm.rollout_correction with `auto` resolved: token_truncate when the trained tokens may be
    sampled off the trainer's policy (`off_policy`: an engine with its own numerics, such as vLLM, or tokens
    sampled by older weights), else none; none when pi_old is the engine's own log-probs
    (algorithm.old_logprobs=rollout: every ratio is 1). `rollout_correction(cfg)` resolves it for a whole
    config."""
    if algo.rollout_correction != "auto":
        return algo.rollout_correction
    return "token_truncate" if off_policy and algo.old_logprobs == "recompute" else "none"


def rollout_correction_weights(old: torch.Tensor, rollout: torch.Tensor, lengths: torch.Tensor, mode: str,
                               cap: float) -> torch.Tensor:
    """The rollout correction as a detached per-token loss factor [T] (fp32; 0 = the token leaves the loss).

    `old` and `rollout` are the flat [T] log-probs of the sampled tokens under the trainer's policy before
    the update and under the engine's sampling distribution, for responses of `lengths` tokens. With the
    ratio rho = exp(old - rollout) (per token; for the sequence modes the geometric mean over the response,
    exp(mean(old - rollout)), given to each of its tokens): truncate -> min(rho, cap); mask -> 1 where
    1/cap <= rho <= cap, else 0; none -> 1. Identical log-probs give exactly 1 in every mode.
    """
    log_rho = torch.clamp(old.double() - rollout.double(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if mode in ("sequence_truncate", "sequence_mask"):
        owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        total = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, owner, log_rho)
        log_rho = (total / lengths.clamp_min(1))[owner]
    if mode in ("token_truncate", "sequence_truncate"):
        return log_rho.exp().clamp(max=cap).to(torch.float32)
    if mode in ("token_mask", "sequence_mask"):
        return (log_rho.abs() <= math.log(cap)).to(torch.float32)
    if mode == "none":
        return torch.ones(log_rho.shape, dtype=torch.float32)
    raise ValueError(f"unknown rollout correction mode {mode!r}")


def rollout_correction_sums(old: torch.Tensor, rollout: torch.Tensor, weights: torch.Tensor,
                            valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Local token statistics of a correction, to reduce over ranks: (sums, extremes).

    sums = [valid tokens, tokens masked by the correction, sum of the weights of the kept ones, kept tokens,
    sum of the k3 estimator rho - 1 - log rho of KL(rollout || old) with the token ratio rho = pi_old /
    pi_rollout] (fp64); extremes = [-min weight, max weight] over the kept tokens (-inf when none), both to
    be reduced with max.
    """
    log_rho = torch.clamp(old.double() - rollout.double(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    valid = valid.bool()
    kept = valid & (weights > 0)
    w = weights.double()
    sums = torch.stack([valid.sum(), (valid & ~kept).sum(), w[kept].sum(), kept.sum(),
                        (log_rho.exp() - 1 - log_rho)[valid].sum()]).double()
    low = float("-inf")
    extremes = torch.tensor([-w[kept].min().item(), w[kept].max().item()] if kept.any() else [low, low],
                            dtype=torch.float64)
    return sums, extremes


@dataclass
class LossStats:
    """Detached token sums of one loss call; add them across micro-batches and ranks, then take `means`.

    Sums rather than means so that a reduction over micro-batches and data-parallel ranks is exact. Every
    count is over valid (mask=1) tokens. The three clip regions are disjoint (c > 1 + eps_high, c > 1), so
    pg_clipfrac = clip_upper + clip_lower + clip_dual and pg_clipfrac_lower = clip_dual.
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
    clip_upper: torch.Tensor
    """Tokens with A > 0 and r > 1 + eps_high: the Clip-Higher bound is active."""
    clip_lower: torch.Tensor
    """Tokens with A < 0 and r < 1 - eps_low."""
    clip_dual: torch.Tensor
    """Tokens with A < 0 and r > c (the dual clip; equals pg_clipfrac_lower)."""
    upclip_old_prob: torch.Tensor
    """Sum of exp(logp_old) over the up-clipped tokens (clip_upper): their mean old-policy probability."""
    upclip_tail: torch.Tensor
    """Up-clipped tokens in the tail of their position's distribution: probability below exp(-H), H the
    position's entropy (both under the current policy; needs `entropy`). Raising such a token always raises H
    (dH along e_a - pi is -pi_a (log pi_a + H) + Cov_pi(pi, log pi), both terms >= 0), so this share says how
    much of what the upper clip holds back would have kept entropy up (docs/ablation.md, A')."""
    tokens_correct: torch.Tensor
    """Valid tokens of responses the verifier judged correct."""
    entropy_correct: torch.Tensor
    """Sum of the entropies of those tokens."""
    tokens_wrong: torch.Tensor
    """Valid tokens of responses judged wrong."""
    entropy_wrong: torch.Tensor
    """Sum of the entropies of those tokens."""

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
        """Per-token means of every statistic (0 when there are no tokens), except the conditional ones
        (`CONDITIONAL_MEANS`), which are means over their own tokens and are left out when there are none
        (a 0 would read as a probability or an entropy)."""
        count = max(float(self.num_tokens), 1.0)
        out = {f.name: float(getattr(self, f.name)) / count for f in fields(self)
               if f.name != "num_tokens" and f.name not in CONDITIONAL_MEANS}
        for name, over in CONDITIONAL_MEANS.items():
            if float(getattr(self, over)) > 0:
                out[name] = float(getattr(self, name)) / float(getattr(self, over))
        return out


CONDITIONAL_MEANS = {"upclip_old_prob": "clip_upper", "upclip_tail": "clip_upper",
                     "entropy_correct": "tokens_correct", "entropy_wrong": "tokens_wrong"}
"""LossStats sums whose mean is over the tokens of another count (value -> its count)."""


def clipped_surrogate(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, algo: AlgorithmConfig):
    """Per-token loss with its clip branches: (loss, ratio, clipped, dual_clipped), all in logp's dtype."""
    ratio = torch.exp(torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - algo.clip_low, 1.0 + algo.clip_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    dual_clipped = torch.zeros_like(clipped)
    if algo.clip_ratio_c is not None:
        loss_dual = -adv * algo.clip_ratio_c
        dual_clipped = (adv < 0) & (per_token > loss_dual)
        per_token = torch.where(dual_clipped, loss_dual, per_token)
    return per_token, ratio, clipped, dual_clipped


def token_loss(
    logp: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    algo: AlgorithmConfig,
    *,
    normalizer: torch.Tensor | float | None = None,
    weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    correct: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Scalar DAPO loss from per-token log-probs (differentiable in `logp`) and detached token sums.

    All inputs are per token [N]: loss = sum over valid tokens of weights * l / normalizer. `normalizer` is
    the global number of valid tokens of the mini-batch (all micro-batches, all ranks), or per token [N]
    what `loss_normalizers` gives the token's response; None uses this call's own count. `weights` is the
    detached rollout-correction factor (None: 1). `entropy` and `correct` (per token, whether its response
    was judged correct; None: unknown, no split) only feed the statistics (DAPO has no entropy bonus). A fully
    masked input gives loss 0 and zero gradient, never NaN. Computes in fp32, or fp64 for fp64 log-probs.
    `old_logprobs=None` is the on-policy loss: pi_old is pi_theta detached (ratio 1, nothing clipped, gradient
    -A dlogp / normalizer), exact when the batch was sampled from the current weights.
    """
    dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
    logp = logp.to(dtype)
    old = logp.detach() if old_logprobs is None else old_logprobs.to(dtype)
    adv, valid = advantages.to(dtype), mask.to(dtype)
    per_token, ratio, clipped, dual_clipped = clipped_surrogate(logp, old, adv, algo)
    if normalizer is None:
        normalizer = valid.sum()
    scale = 1.0 / torch.as_tensor(normalizer, dtype=dtype, device=logp.device).clamp_min(1.0)
    if weights is not None:
        scale = weights.detach().to(dtype) * scale
    # where(), not multiply: a masked token's value must not leak a NaN/inf into the sum or gradient.
    loss = torch.where(valid > 0, per_token * scale, torch.zeros_like(per_token)).sum()

    with torch.no_grad():
        stats = _loss_stats(logp.detach(), old, adv, valid, ratio.detach(), (clipped, dual_clipped), entropy,
                            correct)
    return loss, stats


def _loss_stats(new, old, adv, valid, ratio, clips, entropy, correct) -> LossStats:
    """The detached token sums of `token_loss` (all per token, `valid` 0/1 in the compute dtype)."""
    clipped, dual_clipped = clips
    zero = valid.new_zeros(())
    upper, lower = clipped & (adv > 0), clipped & (adv < 0)  # A = 0 is never clipped: l = 0 on both branches
    ent = (torch.where(valid > 0, entropy.detach().to(valid.dtype), torch.zeros_like(valid))
           if entropy is not None else None)
    right = correct.to(valid.device).bool() if correct is not None else None

    def count(flags: torch.Tensor) -> torch.Tensor:
        return (flags.to(valid.dtype) * valid).sum()

    return LossStats(
        num_tokens=valid.sum(),
        pg_clipfrac=count(clipped | dual_clipped),
        pg_clipfrac_lower=count(dual_clipped),
        ppo_kl=((old - new) * valid).sum(),
        entropy=ent.sum() if ent is not None else zero,
        token_prob=(new.exp() * valid).sum(),
        ratio=(ratio * valid).sum(),
        clip_upper=count(upper),
        clip_lower=count(lower),
        clip_dual=count(dual_clipped),
        # where(): a masked token's old log-prob may be anything, and must not leak into the sum.
        upclip_old_prob=torch.where(upper & (valid > 0), old.exp(), torch.zeros_like(old)).sum(),
        upclip_tail=count(upper & (new + ent < 0)) if ent is not None else zero,
        tokens_correct=count(right) if right is not None else zero,
        entropy_correct=(ent * right).sum() if ent is not None and right is not None else zero,
        tokens_wrong=count(~right) if right is not None else zero,
        entropy_wrong=(ent * ~right).sum() if ent is not None and right is not None else zero,
    )


# Which trained tokens are off the trainer's policy: functions of the config alone (plan reads them too).

def stale_tokens(cfg) -> bool:
    """Whether trained tokens may come from older weights than those the step starts from: streaming's carried
    responses, and in split placement any lag k >= 1 (with dynamic sampling its groups past a batch's target
    also open the next one). `algorithm.rollout_correction=auto` then resolves to token_truncate. At k = 0
    split placement trains what co-located training trains (rounds drop the surplus, as co-located rounds do):
    auto resolves as co-located."""
    rc = cfg.rollout
    carried = rc.streaming and rc.partial_rollouts
    return carried or (rc.placement == "split" and rc.max_lag > 0)


def rollout_correction(cfg) -> str:
    """The run's rollout correction with `auto` resolved: on when the engine samples with its own numerics
    (config/engines.py) or tokens may be stale (`stale_tokens`)."""
    return resolved_rollout_correction(cfg.algorithm,
                                       engine_spec(cfg.rollout.engine).off_policy or stale_tokens(cfg))


def on_policy(cfg) -> bool:
    """One optimizer step per batch (one mini-batch, one epoch): the weights the update starts from are
    the ones that sampled the batch, so pi_old is pi_theta itself and needs no pass of its own. Not with a
    rollout correction: its weights need pi_old's values before the update."""
    return (cfg.trainer.ppo_epochs == 1 and cfg.trainer.mini_batch == cfg.trainer.train_batch
            and rollout_correction(cfg) == "none")

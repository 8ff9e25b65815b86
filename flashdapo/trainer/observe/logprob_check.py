"""Trainer vs rollout-engine log-probs on the tokens the engine sampled (`logprob_agreement`): the check that
the engine samples from the policy the trainer optimizes (same weights, temperature, dtype handling), on an
absolute schedule (the run's first step, then every `rollout.logprob_check_every` steps), so a resumed run
logs what the uninterrupted one did: the global mean and max |delta logp| over every rank's tokens. Above
`rollout.logprob_check_threshold` it warns (LogprobMismatchWarning).

The check after every weight push, which stops a run whose engine does not hold the policy, is
`flashdapo.sync.check` (PushCheck).
"""

from __future__ import annotations

import warnings

import torch

from ...config import RolloutConfig
from ...distributed.collectives import all_reduce
from ..batch import TrainBatch

__all__ = ["LogprobMismatchWarning", "logprob_agreement", "should_check_logprobs", "warn_logprob_mismatch"]


class LogprobMismatchWarning(UserWarning):
    """The engine's and the trainer's log-probs of the same sampled tokens disagree beyond the threshold."""


def should_check_logprobs(step: int, every: int, first_step: int = 0) -> bool:
    """True at `first_step` (the run's first step) and every `every` steps after (only then when every <=
    0)."""
    return step == first_step or (every > 0 and (step - first_step) % every == 0)


def warn_logprob_mismatch(mean: float, worst: float, threshold: float) -> None:
    """LogprobMismatchWarning when the mean |delta logp| exceeds `threshold` (or is NaN)."""
    if not mean <= threshold:  # also catches NaN
        warnings.warn(
            f"mean |logp_engine - logp_trainer| = {mean:.4f} (max {worst:.4f}) exceeds "
            f"rollout.logprob_check_threshold={threshold}. Usual causes: weights not pushed (or reloaded "
            "from disk), temperature not applied the same way, top_p/top_k active (the engine's log-probs "
            "are "
            "renormalized over the tokens the filters keep), dtype differences (fp32 LM head vs bf16).",
            LogprobMismatchWarning, stacklevel=3)


def logprob_agreement(step: int, batch: TrainBatch, rollout: RolloutConfig, warn: bool) -> dict[str, float]:
    """Mean / max |logp_engine - logp_old| over every rank's kept tokens sampled by this step's weights
    (streaming's versions say which), when scheduled at `step` (the first step is 1) and the engine reported
    log-probs; warns (when `warn`, e.g. on the main rank) above the threshold. All ranks must call it
    together. Empty when not scheduled or without engine log-probs."""
    sampled = [lp for g in batch.groups for lp in (g.sampler_logprobs or [])]
    if len(sampled) != len(
            batch.old_logprobs) or not should_check_logprobs(step, rollout.logprob_check_every, 1):
        return {}
    # Streaming may train tokens sampled by older weights (carried or rolled over): those differ by design
    # (the rollout correction handles them); the check compares the tokens this step's weights sampled.
    current = [v == step if g.versions is not None else torch.ones(len(r), dtype=torch.bool)
               for g in batch.groups for v, r in zip(g.versions or [None] * g.size, g.responses)]
    local = torch.cat([(s.float() - o.float()).abs()[m]
                       for s, o, m in zip(sampled, batch.old_logprobs, current)] or [torch.zeros(0)])
    stats = all_reduce(torch.tensor([local.sum().item(), float(local.numel())], dtype=torch.float64))
    peak = all_reduce(torch.tensor([local.max().item() if local.numel() else 0.0]), "max").item()
    mean = stats[0].item() / max(stats[1].item(), 1.0)
    if warn:
        warn_logprob_mismatch(mean, peak, rollout.logprob_check_threshold)
    return {"rollout/logprob_abs_diff_mean": mean, "rollout/logprob_abs_diff_max": peak}

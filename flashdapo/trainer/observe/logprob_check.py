"""Trainer vs rollout-engine log-probs on the tokens the engine sampled (`logprob_agreement`): the check that
the engine samples from the policy the trainer optimizes (same weights, temperature, dtype handling), on an
absolute schedule (the run's first step, then every `rollout.logprob_check_every` steps), so a resumed run
logs what the uninterrupted one did: the global mean and max |delta logp| over every rank's tokens, and the
fraction of those tokens whose two float32 log-probs are bit-equal. Above `rollout.logprob_check_threshold`
(on the mean) it warns (LogprobMismatchWarning).

With trainer.batch_invariant and algorithm.old_logprobs=rollout the engine's log-probs are pi_old itself and
must be the trainer's bits: `exact_check` recomputes them on the same schedule and stops the run at the first
token that differs (`OffPolicyError`, one line naming the response, the position and both values).

The check after every weight push, which stops a run whose engine does not hold the policy, is
`flashdapo.sync.check` (PushCheck).
"""

from __future__ import annotations

import warnings

import torch

from ...config import RolloutConfig
from ...distributed.collectives import all_reduce
from ...errors import FlashdapoError
from ..batch import TrainBatch

__all__ = ["LogprobMismatchWarning", "OffPolicyError", "exact_check", "logprob_agreement",
           "should_check_logprobs", "warn_logprob_mismatch"]


class OffPolicyError(FlashdapoError):
    """trainer.batch_invariant: an engine log-prob is not the trainer's bits."""


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
    """Mean / max |logp_engine - logp_old| and the fraction of bit-equal pairs (both as float32) over every
    rank's kept tokens sampled by this step's weights (streaming's versions say which), when scheduled at
    `step` (the first step is 1) and the engine reported log-probs; warns (when `warn`, e.g. on the main
    rank) above the threshold. All ranks must call it together. Empty when not scheduled or without engine
    log-probs."""
    sampled = [lp for g in batch.groups for lp in (g.sampler_logprobs or [])]
    if len(sampled) != len(
            batch.old_logprobs) or not should_check_logprobs(step, rollout.logprob_check_every, 1):
        return {}
    # Streaming may train tokens sampled by older weights (carried or rolled over): those differ by design
    # (the rollout correction handles them); the check compares the tokens this step's weights sampled.
    current = [v == step if g.versions is not None else torch.ones(len(r), dtype=torch.bool)
               for g in batch.groups for v, r in zip(g.versions or [None] * g.size, g.responses)]
    engine = torch.cat([s.float()[m] for s, m in zip(sampled, current)] or [torch.zeros(0)])
    trainer = torch.cat([o.float()[m] for o, m in zip(batch.old_logprobs, current)] or [torch.zeros(0)])
    local = (engine - trainer).abs()
    # Token-weighted over ranks: every rank's sums and token count, then one division.
    equal = (engine == trainer).sum().item()
    stats = all_reduce(torch.tensor([local.sum().item(), equal, local.numel()], dtype=torch.float64))
    peak = all_reduce(torch.tensor([local.max().item() if local.numel() else 0.0]), "max").item()
    total = stats[2].item()
    mean = stats[0].item() / max(total, 1.0)
    exact = stats[1].item() / total if total else 1.0  # no token compared: none differs, as mean/max say
    if warn:
        warn_logprob_mismatch(mean, peak, rollout.logprob_check_threshold)
    return {"rollout/logprob_abs_diff_mean": mean, "rollout/logprob_abs_diff_max": peak,
            "rollout/logprob_exact_fraction": exact}


def exact_check(step: int, groups, recomputed: list[torch.Tensor],
                rollout: RolloutConfig) -> dict[str, float]:
    """trainer.batch_invariant with old_logprobs=rollout: the log-prob check's metrics of the engine's
    log-probs against `recomputed` (the trainer's, in the order of the groups' responses), and OffPolicyError
    on every rank when any rank holds a token whose two values differ by a bit (the first such token of this
    rank named). All ranks call it together, on the check's schedule."""
    view = _Checked(groups, tuple(recomputed))
    metrics = logprob_agreement(step, view, rollout, warn=False)
    if metrics.get("rollout/logprob_exact_fraction", 1.0) == 1.0:
        return metrics
    where = "on another rank"
    responses = [(gi, r) for gi, g in enumerate(groups) for r in range(g.size)]
    sampled = [lp for g in groups for lp in g.sampler_logprobs]
    for i, (engine, trainer) in enumerate(zip(sampled, recomputed)):
        differs = torch.nonzero(engine.float() != trainer.float())
        if len(differs):
            t = int(differs[0, 0])
            where = (f"response {i} of this rank's batch (group {responses[i][0]}, its response "
                     f"{responses[i][1]}), token {t}: engine {float(engine[t])!r}, "
                     f"trainer {float(trainer[t])!r}")
            break
    raise OffPolicyError(
        f"step {step}: trainer.batch_invariant: the engine's log-probs are not the trainer's "
        f"({1 - metrics['rollout/logprob_exact_fraction']:.3%} of the tokens differ; first: {where}); "
        "something outside the batch-invariant forward changed the numerics (weights changed between "
        "sampling and scoring, another kernel, a machine whose GEMMs are not row-invariant)")


class _Checked:
    """A batch's groups with other old log-probs, as logprob_agreement reads a TrainBatch."""

    def __init__(self, groups, old_logprobs: tuple[torch.Tensor, ...]) -> None:
        self.groups, self.old_logprobs = groups, old_logprobs

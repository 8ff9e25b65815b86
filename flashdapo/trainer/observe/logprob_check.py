"""Trainer vs rollout-engine log-probs: the check that the engine samples from the policy the trainer
optimizes (same weights, temperature, dtype handling). Two of them:

- **On the sampled tokens** (`logprob_agreement`), on an absolute schedule (the run's first step, then every
  `rollout.logprob_check_every` steps), so a resumed run logs what the uninterrupted one did: the global
  mean and max |delta logp| over every rank's tokens. Above `rollout.logprob_check_threshold` it warns
  (LogprobMismatchWarning).
- **After every weight push** (`PushCheck`, the vLLM engine's `verify_push`): the engine's log-probs of a
  few fixed tokens (`PROBE_SEQUENCES` sequences of `PROBE_LENGTH` tokens drawn once from the vocabulary,
  the same on every rank) against the trainer's, both at temperature 1 from fp32 logits. Beyond
  `PUSH_TOLERANCE` for the engine's weight dtype (max |delta logp| over the probe; fp32 agrees to ~1e-6,
  bf16 weights cost up to ~1e-2) the run stops with one line naming the parameter groups where the two
  forwards part (`vllm_probe.py`): a stale or unloaded head, a layer left out of the push. Its cost (one
  scoring request and one trainer forward over the probe) is logged with the first two pushes.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from ...config import RolloutConfig
from ...distributed.collectives import all_reduce
from ...errors import FlashdapoError
from ...models.hf import group_modules
from ...rollout.vllm_probe import stream_of, vllm_group_outputs
from ..batch import TrainBatch

__all__ = ["PROBE_LENGTH", "PROBE_SEQUENCES", "PUSH_TOLERANCE", "LogprobMismatchWarning", "PushCheck",
           "PushMismatchError", "logprob_agreement", "should_check_logprobs", "warn_logprob_mismatch"]

PROBE_SEQUENCES, PROBE_LENGTH = 2, 12
PUSH_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}
"""Largest |logp_engine - logp_trainer| over the probe tokens a correct push shows, by the engine's weight
dtype (measured on the toy model: fp32 ~5e-6; bf16 weights against an fp32 trainer ~3e-2; a stale tied
head 0.76)."""


class LogprobMismatchWarning(UserWarning):
    """The engine's and the trainer's log-probs of the same sampled tokens disagree beyond the threshold."""


def should_check_logprobs(step: int, every: int, first_step: int = 0) -> bool:
    """True at `first_step` (the run's first step) and every `every` steps after (only then when every <= 0)."""
    return step == first_step or (every > 0 and (step - first_step) % every == 0)


def warn_logprob_mismatch(mean: float, worst: float, threshold: float) -> None:
    """LogprobMismatchWarning when the mean |delta logp| exceeds `threshold` (or is NaN)."""
    if not mean <= threshold:  # also catches NaN
        warnings.warn(
            f"mean |logp_engine - logp_trainer| = {mean:.4f} (max {worst:.4f}) exceeds "
            f"rollout.logprob_check_threshold={threshold}. Usual causes: weights not pushed (or reloaded "
            "from disk), temperature not applied the same way, top_p/top_k active (the engine's log-probs are "
            "renormalized over the tokens the filters keep), dtype differences (fp32 LM head vs bf16).",
            LogprobMismatchWarning, stacklevel=3)


def logprob_agreement(step: int, batch: TrainBatch, rollout: RolloutConfig, warn: bool) -> dict[str, float]:
    """Mean / max |logp_engine - logp_old| over every rank's kept tokens sampled by this step's weights
    (streaming's versions say which), when scheduled at `step` (the first step is 1) and the engine reported
    log-probs; warns (when `warn`, e.g. on the main rank) above the threshold. All ranks must call it together. Empty when not scheduled or without engine log-probs."""
    sampled = [lp for g in batch.groups for lp in (g.sampler_logprobs or [])]
    if len(sampled) != len(batch.old_logprobs) or not should_check_logprobs(step, rollout.logprob_check_every, 1):
        return {}
    # Streaming may train tokens sampled by older weights (carried or rolled over): those differ by design
    # (the rollout correction handles them); the check compares the tokens this step's weights sampled.
    current = [v == step if g.versions is not None else torch.ones(len(r), dtype=torch.bool)
               for g in batch.groups for v, r in zip(g.versions or [None] * g.size, g.responses)]
    local = torch.cat([(s.float() - o.float()).abs()[m] for s, o, m in zip(sampled, batch.old_logprobs, current)] or
                      [torch.zeros(0)])
    stats = all_reduce(torch.tensor([local.sum().item(), float(local.numel())], dtype=torch.float64))
    peak = all_reduce(torch.tensor([local.max().item() if local.numel() else 0.0]), "max").item()
    mean = stats[0].item() / max(stats[1].item(), 1.0)
    if warn:
        warn_logprob_mismatch(mean, peak, rollout.logprob_check_threshold)
    return {"rollout/logprob_abs_diff_mean": mean, "rollout/logprob_abs_diff_max": peak}


class PushMismatchError(FlashdapoError):
    """The engine's log-probs after a weight push differ from the trainer's beyond the tolerance."""


class PushCheck:
    """`verify_push` for the vLLM engine: after each push, its log-probs of the fixed probe tokens against
    the policy's (every rank together: the policy forward may gather FSDP2 shards)."""

    def __init__(self, policy: Any, device: torch.device, vocab_size: int, log=print):
        gen = torch.Generator().manual_seed(0)
        self.probe = torch.randint(0, vocab_size, (PROBE_SEQUENCES, PROBE_LENGTH), generator=gen).tolist()
        self.policy, self.device, self.log = policy, device, log
        self.pushes, self.last_s, self.last_max = 0, 0.0, 0.0

    @torch.no_grad()
    def trainer_logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """log pi(token t | tokens < t) for t >= 1 of each sequence, temperature 1, from the policy."""
        policy, temperature = self.policy, self.policy.temperature
        seqs = [torch.tensor(s, dtype=torch.long) for s in sequences]
        policy.temperature = 1.0  # the engine's prompt log-probs come from raw logits
        try:
            batch = policy.token_batch([s[:1] for s in seqs], [s[1:] for s in seqs], self.device)
            logp, _ = policy(batch)
        finally:
            policy.temperature = temperature
            if hasattr(policy, "reshard"):  # FSDP2 keeps the root unsharded after a forward without backward
                policy.reshard()
        return list(logp.float().cpu().split(batch.token_counts))

    def __call__(self, engine: Any) -> None:
        start = time.perf_counter()
        diff = (torch.cat(engine.score(self.probe)) - torch.cat(self.trainer_logprobs(self.probe))).abs()
        stats = all_reduce(torch.tensor([diff.max().item(), diff.mean().item()], dtype=torch.float64), "max")
        worst, mean = stats.tolist()
        tolerance = PUSH_TOLERANCE.get(engine.weight_dtype, PUSH_TOLERANCE[torch.float32])
        self.pushes += 1
        self.last_s, self.last_max = time.perf_counter() - start, worst
        if not worst <= tolerance:  # also NaN
            raise PushMismatchError(
                f"after weight push {self.pushes} vLLM's log-probs of {diff.numel()} fixed tokens differ from "
                f"the trainer's by {worst:.3g} max ({mean:.3g} mean), beyond {tolerance} for "
                f"{str(engine.weight_dtype).removeprefix('torch.')} weights; {self.localize(engine)}. The push "
                "left weights stale or unloaded (or the engine computes differently): see docs/vllm.md")
        if self.pushes <= 2:  # the first includes one-time costs (vLLM compiles its log-prob gather)
            self.log(f"weight push {self.pushes} checked: max |logp_vllm - logp_trainer| {worst:.2g} over "
                     f"{diff.numel()} fixed tokens (tolerance {tolerance}); the check took {self.last_s:.3f} s")

    @torch.no_grad()
    def localize(self, engine: Any) -> str:
        """'parameter groups that differ most: ...' from both forwards over the first probe sequence."""
        sequence = self.probe[0]
        theirs = vllm_group_outputs(engine.llm, lambda: engine.score([sequence]),
                                    self.policy.config.model_type)
        mine: dict[str, torch.Tensor] = {}
        groups = group_modules(self.policy.hf, self.policy.config.model_type)
        handles = [module.register_forward_hook(lambda _m, _i, out, name=name: mine.__setitem__(
            name, stream_of(name, out))) for name, module in groups]
        try:
            engine_logp = engine.score([sequence])[0]
            trainer_logp = self.trainer_logprobs([sequence])[0]
        finally:
            for handle in handles:
                handle.remove()
        if not theirs:
            return "vLLM's layer outputs could not be recorded (a compiled or graph-captured forward)"
        errors, previous = [], 0.0
        for name, _ in groups:
            if name not in theirs or name not in mine:
                continue
            ref, got = mine[name], theirs[name][: len(mine[name])]
            error = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            errors.append((error - previous, name, error))
            previous = max(previous, error)
        head = (engine_logp - trainer_logp).abs().max().item()
        errors.append((head if previous < 1e-2 else 0.0, "lm_head", head))
        worst = sorted(errors, reverse=True)[:3]
        return "parameter groups that differ most (the relative error their output adds; the head: max |delta " \
            "logp|): " + ", ".join(f"{name} ({max(added, 0.0):.2g})" for added, name, _ in worst)

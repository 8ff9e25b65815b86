"""Trainer vs rollout-engine log-probs: the check that the engine samples from the policy the trainer
optimizes (same weights, temperature, dtype handling). Two of them:

- **On the sampled tokens** (`logprob_agreement`), on an absolute schedule (the run's first step, then every
  `rollout.logprob_check_every` steps), so a resumed run logs what the uninterrupted one did: the global
  mean and max |delta logp| over every rank's tokens. Above `rollout.logprob_check_threshold` it warns
  (LogprobMismatchWarning).
- **After every weight push** (`PushCheck`, the vLLM engine's `verify_push`): the engine's log-probs of
  fixed tokens (`PROBE_SEQUENCES` sequences of `PROBE_LENGTH` tokens drawn once from the tokenizer's ids,
  never the vocabulary's untrained padding, the same on every rank) against the trainer's, both at
  temperature 1 from fp32 logits. Beyond the tolerance the run stops with one line naming the parameter
  groups where the two forwards part (`vllm_probe.py`): a stale or unloaded head, a layer left out of the
  push. Its cost (one scoring request and one trainer forward over the probe) is logged with the first two
  pushes.

The push check's tolerance. fp32 weights: max |delta logp| <= 1e-3 (the two fp32 forwards agree to ~1e-6).
bf16 (fp16) weights: the two sides are two bf16 computations on the same weights, each off the exact result
by its own rounding, an error that grows with the model's width, depth and the tokens' positions (vLLM vs
HF differences of 0.1-0.3 on single tokens are reported for Qwen models, vllm#18352), so no fixed number
fits every model. The check measures it instead (`calibrate`, at the process's first bf16 push): the
trainer's log-probs of the probe in fp32 arithmetic on the same bf16-rounded weights (`reference_logprobs`:
one decoder layer at a time from the full tensors, as the push streams them), and the trainer's own bf16
error against that, mean and max over the probe. A correct push leaves vLLM about as far from the
trainer as the trainer is from the exact result (two independent errors of that size: ~1.4x; the two
correlate, measured 1.1-1.2x); weights that are wrong add their own error. The push passes when

    mean |logp_vllm - logp_trainer| <= MEAN_FACTOR x mean error + MEAN_FLOOR
    max  |logp_vllm - logp_trainer| <= MAX_FACTOR x max error + MAX_FLOOR

over the probe's tokens (the mean decides; the max, looser, catches damage confined to a few tokens).
Measured on CPU with vLLM's CPU build (docs/vllm.md, "The push check's tolerance"; Qwen2, Qwen3, Llama,
Mistral configs of hidden 512-1024): a correct push sits at 1.07-1.22x the trainer's mean error, a decoder
layer scaled by 1.01 at 2.39-2.92x, a layer holding another init at 106-142x, a stale tied head (HF double)
at 177-189x; one weight matrix off by 1% moves log-probs less than bf16 arithmetic does, and no log-prob
check that tolerates bf16 sees it.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...config import RolloutConfig
from ...distributed.collectives import all_reduce
from ...errors import FlashdapoError
from ...models.hf import group_modules
from ...models.weights import iter_full_state_dict
from ...rollout.vllm_probe import stream_of, vllm_group_outputs
from ..batch import TrainBatch

__all__ = ["MAX_FACTOR", "MAX_FLOOR", "MEAN_FACTOR", "MEAN_FLOOR", "PROBE_LENGTH", "PROBE_SEQUENCES", "PUSH_TOLERANCE",
           "Calibration", "LogprobMismatchWarning", "PushCheck", "PushMismatchError", "logprob_agreement",
           "probe_sequences", "reference_logprobs", "should_check_logprobs", "warn_logprob_mismatch"]

PROBE_SEQUENCES, PROBE_LENGTH = 8, 32
"""The probe: 8 x 31 = 248 scored tokens, enough for a mean |delta logp| steady to a few percent; each
sequence, plus the one token vLLM samples after it, must fit max_model_len (data.max_prompt_length +
rollout.max_response_length >= 33)."""
PUSH_TOLERANCE = {torch.float32: 1e-3}
"""Largest |logp_engine - logp_trainer| over the probe a correct push shows when both compute in fp32
(measured on the toy: ~5e-7). Low-precision weights are checked against a measured tolerance (below)."""
MEAN_FACTOR, MAX_FACTOR = 2.0, 3.0
"""Multiples of the trainer's own bf16 error on the probe (mean, max) a push may show (module docstring)."""
MEAN_FLOOR = {torch.bfloat16: 5e-4, torch.float16: 1e-4}
MAX_FLOOR = {torch.bfloat16: 5e-3, torch.float16: 1e-3}
"""Added to the measured tolerances: an error measured near 0 must not make the check fail on noise."""


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


def probe_sequences(tokens: int) -> list[list[int]]:
    """The probe: PROBE_SEQUENCES sequences of PROBE_LENGTH ids below `tokens`, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, tokens, (PROBE_SEQUENCES, PROBE_LENGTH), generator=gen).tolist()


@dataclass(frozen=True)
class Calibration:
    """The trainer's own low-precision error on the probe (against fp32 arithmetic on the same weights), and
    the tolerances it gives (module docstring)."""

    dtype: torch.dtype
    mean: float
    max: float

    @property
    def mean_limit(self) -> float:
        return MEAN_FACTOR * self.mean + MEAN_FLOOR.get(self.dtype, MEAN_FLOOR[torch.bfloat16])

    @property
    def max_limit(self) -> float:
        return MAX_FACTOR * self.max + MAX_FLOOR.get(self.dtype, MAX_FLOOR[torch.bfloat16])

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return (f"{self.mean_limit:.3g} mean / {self.max_limit:.3g} max: {MEAN_FACTOR:g} / {MAX_FACTOR:g} x the "
                f"trainer's own {name} error on these tokens against fp32 arithmetic ({self.mean:.3g} mean, "
                f"{self.max:.3g} max)")


def _group_of(name: str, groups: list[str]) -> str | None:
    """The parameter group ('embed_tokens', 'layers.3', 'norm', 'lm_head') an HF tensor name belongs to."""
    if name.startswith("lm_head."):
        return "lm_head"
    for group in groups:
        if name.startswith(f"model.{group}."):
            return group
    return None


@torch.no_grad()
def reference_logprobs(hf: Any, sequences: list[list[int]], device: torch.device,
                       weight_dtype: torch.dtype | None, tensors: Iterator[tuple[str, torch.Tensor]] | None = None
                       ) -> list[torch.Tensor]:
    """log pi(token t | tokens < t) for t >= 1 of each sequence (all of one length), temperature 1, in fp32
    arithmetic on the policy's weights rounded to `weight_dtype` (what the engine holds). Built one parameter
    group at a time (embedding, each decoder layer, final norm, head) from the full tensors of
    `iter_full_state_dict(hf, weight_dtype)` (or `tensors`), into a fresh fp32 copy of that group of the
    model's own classes, so that memory holds one group at a time; under FSDP2 every rank must call it
    together (the tensors are all-gathered). Eager attention with an explicit causal mask."""
    stream = iter(tensors if tensors is not None else iter_full_state_dict(hf, dtype=weight_dtype))
    config = copy.deepcopy(hf.config)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        skeleton = type(hf)(config)
    groups = [name for name, _ in group_modules(skeleton, config.model_type)]
    modules = dict(group_modules(skeleton, config.model_type))
    ids = torch.tensor(sequences, dtype=torch.long, device=device)
    count, length = ids.shape
    positions = torch.arange(length, device=device).expand(count, length)
    mask = torch.full((length, length), torch.finfo(torch.float32).min, device=device).triu(1)
    mask = mask[None, None].expand(count, 1, length, length)
    state: dict[str, Any] = {"hidden": None, "embedding": None, "head": None, "rope": None}

    def run(group: str, tensors: dict[str, torch.Tensor]) -> None:
        if group == "lm_head":
            state["head"] = tensors["weight"]
            return
        module = modules[group].to_empty(device=device)
        module.load_state_dict({k: v.to(device=device, dtype=torch.float32) for k, v in tensors.items()})
        if group == "embed_tokens":
            state["hidden"] = module(ids).float()
            state["embedding"] = tensors["weight"] if getattr(config, "tie_word_embeddings", False) else None
            state["rope"] = hf.model.rotary_emb(state["hidden"], positions)
        elif group == "norm":
            state["hidden"] = module(state["hidden"])
        else:
            out = module(state["hidden"], attention_mask=mask, position_ids=positions,
                         position_embeddings=state["rope"])
            state["hidden"] = out[0] if isinstance(out, tuple) else out
        module.to("meta")

    current, held = None, {}
    for name, tensor in stream:
        group = _group_of(name, groups)
        if group is None:
            continue
        if group != current and current is not None:
            run(current, held)
            held = {}
        current = group
        held[name.removeprefix("lm_head." if group == "lm_head" else f"model.{group}.")] = tensor.detach()
    if current is not None:
        run(current, held)
    head = state["head"] if state["head"] is not None else state["embedding"]
    if head is None or state["hidden"] is None:
        raise RuntimeError(f"the push check's fp32 reference found no {'LM head' if state['hidden'] is not None else 'embedding'}"
                           f" among {type(hf).__name__}'s full tensors")
    hidden = state["hidden"][:, :-1].reshape(-1, state["hidden"].shape[-1]).float()
    logits = torch.cat([hidden @ rows.to(device=device, dtype=torch.float32).T for rows in head.split(16384)], -1)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].reshape(-1, 1)).squeeze(1)
    return list(logp.float().cpu().split(length - 1))


def _experts_note(config: Any) -> str:
    """For a mixture-of-experts model, how its experts show in the localisation (each one is compared only
    through its decoder layer's output, as the tokens routed to it shape that output)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if not experts:
        return ""
    return (f" (a MoE layer's output holds its router and its {experts} experts: a wrong expert shows as its "
            "layer, where the probe's tokens are routed to it)")


class PushCheck:
    """`verify_push` for the vLLM engine: after each push, its log-probs of the fixed probe tokens against
    the policy's (every rank together: the policy forward may gather FSDP2 shards)."""

    def __init__(self, policy: Any, device: torch.device, vocab_size: int, log=print, *,
                 tokenizer_size: int | None = None):
        """`vocab_size`: the model's rows; `tokenizer_size`: len(tokenizer), the ids the probe draws from
        (the rows past it are padding, never trained: their log-probs mean nothing); the smaller of the two."""
        tokens = vocab_size if tokenizer_size is None else min(vocab_size, tokenizer_size)
        self.probe = probe_sequences(tokens)
        self.policy, self.device, self.log = policy, device, log
        self.pushes, self.last_s, self.last_max, self.last_mean = 0, 0.0, 0.0, 0.0
        self.calibration: Calibration | None = None

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

    def calibrate(self, dtype: torch.dtype | None, trainer: torch.Tensor, engine: torch.Tensor) -> Calibration:
        """The trainer's error on the probe against fp32 arithmetic on the `dtype` weights (every rank
        together); logs it with the engine's own error against the same reference."""
        start = time.perf_counter()
        reference = torch.cat(reference_logprobs(self.policy.hf, self.probe, self.device, dtype))
        mine, theirs = (trainer - reference).abs(), (engine - reference).abs()
        stats = all_reduce(torch.tensor([mine.mean().item(), mine.max().item(), theirs.mean().item(),
                                         theirs.max().item()], dtype=torch.float64), "max").tolist()
        calibration = Calibration(dtype or torch.bfloat16, stats[0], stats[1])
        self.log(f"push check calibrated on {mine.numel()} fixed tokens against fp32 arithmetic on the pushed "
                 f"weights: the trainer's log-probs are off by {stats[0]:.3g} mean ({stats[1]:.3g} max), vLLM's by "
                 f"{stats[2]:.3g} mean ({stats[3]:.3g} max); tolerance for vLLM vs the trainer "
                 f"{calibration.describe()} (took {time.perf_counter() - start:.2f} s)")
        return calibration

    def __call__(self, engine: Any) -> None:
        start = time.perf_counter()
        engine_logp = torch.cat(engine.score(self.probe))
        trainer_logp = torch.cat(self.trainer_logprobs(self.probe))
        dtype = engine.weight_dtype
        low_precision = dtype != torch.float32
        if low_precision and self.calibration is None:
            self.calibration = self.calibrate(dtype, trainer_logp, engine_logp)
        diff = (engine_logp - trainer_logp).abs()
        stats = all_reduce(torch.tensor([diff.max().item(), diff.mean().item()], dtype=torch.float64), "max")
        worst, mean = stats.tolist()
        self.pushes += 1
        self.last_s, self.last_max, self.last_mean = time.perf_counter() - start, worst, mean
        if low_precision:
            assert self.calibration is not None
            calibration = self.calibration
            passed = mean <= calibration.mean_limit and worst <= calibration.max_limit
            tolerance = f"{calibration.mean_limit:.3g} mean / {calibration.max_limit:.3g} max"
            why = calibration.describe()
        else:
            passed, tolerance = worst <= PUSH_TOLERANCE[torch.float32], f"{PUSH_TOLERANCE[torch.float32]:g} max"
            why = tolerance
        if not passed:  # also NaN
            raise PushMismatchError(
                f"after weight push {self.pushes} vLLM's log-probs of {diff.numel()} fixed tokens differ from "
                f"the trainer's by {mean:.3g} mean ({worst:.3g} max), beyond {why} for "
                f"{str(dtype).removeprefix('torch.')} weights; {self.localize(engine)}. The push "
                "left weights stale or unloaded (or the engine computes differently): see docs/vllm.md")
        if self.pushes <= 2:  # the first includes one-time costs (vLLM compiles its log-prob gather)
            self.log(f"weight push {self.pushes} checked: max |logp_vllm - logp_trainer| {worst:.2g}, mean {mean:.2g} "
                     f"over {diff.numel()} fixed tokens (tolerance {tolerance}); the check took {self.last_s:.3f} s")

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
            "logp|): " + ", ".join(f"{name} ({max(added, 0.0):.2g})" for added, name, _ in worst) + \
            _experts_note(self.policy.config)

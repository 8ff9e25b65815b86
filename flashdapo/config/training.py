"""Config sections of running the training: the optimizer (`optim`), batch geometry, devices and
parallelism (`trainer`), checkpoints (`checkpoint`) and the run directory and logs (`logging`).
The root of the tree is tree.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from ..kernels import KernelImpl
from .checks import (
    BATCH_MAX,
    BATCH_WHY,
    IS_PATH,
    SEED_MAX,
    TIMEOUT_MAX_S,
    TOKENS_MAX,
    Check,
    NonNegative,
    PathStr,
    Positive,
    PositiveFloat,
    Rule,
    Section,
    at_most,
    ge,
)

STEPS_MAX = 10_000_000
"""The most training steps of a run (the released recipe trains 400)."""
TIMEOUT_WHY = "a week; the process group's clock counts integer milliseconds"
HEARTBEAT_MAX_S = 24 * 3600.0
"""The longest logging.heartbeat_s, a day (a thread's wait takes no longer timeout)."""

HEARTBEAT_MIN_S = 1.0
"""The shortest logging.heartbeat_s: a line per second at most."""


@dataclass
class OptimConfig(Section):
    """AdamW with linear warmup then a constant learning rate."""

    lr: PositiveFloat = 1e-6
    """Peak learning rate."""
    betas: Annotated[tuple[float, float],
                     Check(lambda b: all(0 <= x < 1 for x in b), "two values in [0, 1)")] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: Annotated[float, ge(0)] = 0.1
    """AdamW decoupled weight decay."""
    eps: PositiveFloat = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Max global gradient norm (<= 0 disables clipping)."""
    warmup_steps: NonNegative = 10
    """Linear warmup from lr / warmup_steps to lr, then constant; counted in TRAINING steps (each holds
    train_batch / mini_batch optimizer steps), as the paper's 20 and the released recipe's 10 are. The
    schedule advances only after a training step that took an optimizer step (one that kept no group, or
    skipped every update as non-finite, does not count)."""


@dataclass
class TrainerConfig(Section):
    """Batch geometry, schedule, devices and parallelism."""

    total_steps: Annotated[Positive,
                           at_most(STEPS_MAX, "training steps; each generates and trains a batch")] = 100
    """Training steps (each: rollouts of train_batch prompts, then train_batch/mini_batch optimizer steps)."""
    train_batch: Annotated[Positive, at_most(BATCH_MAX, BATCH_WHY)] = 512
    """Prompts kept per step after dynamic sampling (all ranks together)."""
    gen_batch: Annotated[Positive, at_most(BATCH_MAX, BATCH_WHY)] = 1536
    """Prompts sampled per generation round (all ranks together)."""
    mini_batch: Annotated[Positive, at_most(BATCH_MAX, BATCH_WHY)] = 32
    """Prompts per optimizer step; train_batch / mini_batch optimizer steps per training step."""
    ppo_epochs: Annotated[Positive, at_most(1000, "passes over each step's batch")] = 1
    """Passes over each step's batch."""
    micro_batch_tokens: Annotated[Positive, at_most(4 * TOKENS_MAX, "tokens of one rank's forward and "
                                                                    "backward")] = \
        22528
    """Token budget of one forward/backward micro-batch on one rank: real tokens when packed
    (pack_sequences), rows x longest row when padded. With sequence_parallel = sp a micro-batch holds up to
    sp x this many tokens, 1/sp of them on each rank of its group."""
    pack_sequences: bool = True
    """Micro-batches as one packed row (no padding), attention per response (flash-attn varlen with
    model.attn_implementation=flash_attention_2, else torch SDPA per response); False: right-padded rows."""
    kernel_impl: KernelImpl = "auto"
    """Log-prob/loss implementation (auto: triton on CUDA, chunked torch elsewhere)."""
    batch_invariant: bool = False
    """A batch-invariant forward for the trainer and the torch engine alike (models/invariant.py): a token's
    log-prob is the same bits in the engine's decode step, the old-log-prob pass and the update, so
    algorithm.old_logprobs=rollout is exact and the old-log-prob pass runs only on the scheduled checks
    (rollout.logprob_check_every), which stop the run at the first differing token. Costs generation and
    update time. With rollout.engine vllm (CUDA; not yet run on a GPU): vLLM's batch-invariant mode, the
    trainer on vLLM's kernels (docs/algorithm.md, "Exact on-policy")."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available."""
    seed: Annotated[NonNegative, SEED_MAX] = 0
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
    around attention). Must divide the world size; the model's query heads must divide by it, and its
    key/value heads must divide by it or divide it (then each is repeated sp / kv_heads times). The rollout
    engines do not use it."""
    expert_parallel: Positive = 1
    """Expert parallelism for mixture-of-experts models: ranks per group that split each MoE layer's experts
    (num_experts / E each; tokens travel to their experts' rank and back by all-to-all). Must divide the
    data-parallel world size (all trainer ranks) and the model's num_experts; 1 for a dense model."""
    collective_timeout_s: Annotated[Positive, at_most(TIMEOUT_MAX_S, TIMEOUT_WHY)] = 1800
    """Seconds a collective may wait for the other ranks before it fails: a backstop for a rank that
    hangs without raising (a rank that raises ends the job at once)."""
    setup_timeout_s: Annotated[Positive, at_most(TIMEOUT_MAX_S, TIMEOUT_WHY)] = 120
    """Seconds a collective of the start-up checks (the run directory every rank must see, the checkpoint
    rank 0 resumes from) may wait for the other ranks: ranks that disagree at start fail within this,
    not after collective_timeout_s. Loading the model and later collectives use collective_timeout_s."""
    max_skipped_steps: Positive = 5
    """Consecutive optimizer steps skipped for a non-finite loss or gradient norm before the run stops
    (naming the step and the newest good checkpoint)."""

    RULES = (
        Rule("mini_batch", lambda c: c.train_batch % c.mini_batch == 0,
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
    resume: PathStr = ""
    """'' starts fresh; 'auto' resumes from the newest complete checkpoint in the run directory (fresh if
    none); a path resumes from that checkpoint."""
    allow_changes: list[str] = field(default_factory=list)
    """Settings a resume may change from the checkpoint's (field paths such as optim.lr or
    data.train_files, or a section such as optim; see flashdapo/trainer/state/run_settings.py for what is
    recorded). A resume with any other change is refused, naming each field old -> new; an accepted change
    is logged and recorded in run.json, and a changed optim.lr is the rate the resumed optimizer uses."""
    export_hf: bool = True
    """Write an HF-format export (safetensors, config, tokenizer) of the final policy; under LoRA a PEFT
    adapter directory naming its base (docs/lora.md)."""
    export_merged: bool = False
    """LoRA: also write the merged policy (base + adapters) as a plain HF checkpoint in export-merged/."""


@dataclass
class LoggingConfig(Section):
    """Run directory, console output and metric sinks."""

    run_dir: Annotated[str, IS_PATH, Check(bool, "a non-empty path")] = "runs/flashdapo"
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
    heartbeat_s: Annotated[float, Check(lambda s, low=HEARTBEAT_MIN_S: s == 0 or s >= low,
                                        f"0 (never) or at least {HEARTBEAT_MIN_S:g} seconds"),
                           at_most(HEARTBEAT_MAX_S, "a day; a thread's wait takes no longer timeout")] = 60.0
    """A step still running after this many seconds prints a line naming the stage it is in and how long it
    has run, and again every as many seconds (rank 0; 0: never; at least 1 s: shorter would flood the log
    with lines that say nothing new)."""
    probe_every: NonNegative = 5
    """Every N steps (and before training, with trainer.val_before_train) measure the
    policy on the probe set: probe/entropy and probe/top1_prob, the mean entropy and top-1 probability over
    fixed teacher-forced responses (trainer/observe/probe.py; 0: never)."""
    probe_prompts: Annotated[Positive, at_most(BATCH_MAX, BATCH_WHY)] = 32
    """Prompts of the probe set: the first this many distinct validation prompts (training prompts when the
    run has no validation set), each with the response 'Answer: <reference answer>'."""
    dump_rollouts_every: NonNegative = 0
    """Every N steps write the step's rollouts (prompt, responses, scores, advantages, trained / filtered /
    unused, or next_step under rollout.streaming) and, at validations on such steps, the validation
    generations as jsonl under RUN_DIR/rollouts/ (0: never)."""
    move_old_run: bool = False
    """A fresh run whose run_dir holds a previous run's checkpoints, metrics or export: move those files to
    `<run_dir>.old-<UTC time>/` (nothing is deleted) and start. Off: refuse, naming the choices."""
    warnings_as_errors: bool = False
    """Stop the run at the first warning flashdapo raises, as one error line (for CI; `python -W error`
    does the same for every warning, other packages' too). Off: each warning prints one line,
    `flashdapo: warning: ...`, also written to RUN_DIR/warnings.log; one that recurs every step prints
    once, with a count at the end of the run."""

"""THE config tree of flashdapo: one set of dataclasses, the CLI derived from it, named presets.

Every field has its default here and nowhere else; presets are functions that override fields of the
default tree; the CLI (`flashdapo train --help`) is generated from these dataclasses and their field
docstrings by tyro. Validation runs at construction and names the field and the allowed values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config value is invalid; the message names the field."""


def _require(ok: bool, name: str, expected: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name}: expected {expected}, got {value!r}")


@dataclass
class ToyModelConfig:
    """Shape of the tiny Qwen2-style model built from a config when `model.path` is empty."""

    hidden_size: int = 64
    """Model width."""
    num_layers: int = 2
    """Decoder blocks."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 192
    """MLP width."""
    sft_steps: int = 300
    """Supervised warm-up steps on the toy task that make the 'base model' before DAPO (0 disables)."""
    sft_lr: float = 3e-3
    """Learning rate of the supervised warm-up."""
    sft_batch: int = 32
    """Examples per supervised warm-up step."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "sft_batch"):
            _require(getattr(self, name) > 0, f"model.toy.{name}", "a positive integer", getattr(self, name))
        _require(self.hidden_size % self.num_heads == 0, "model.toy.hidden_size", "a multiple of num_heads",
                 self.hidden_size)
        _require(self.num_heads % self.num_kv_heads == 0, "model.toy.num_kv_heads", "a divisor of num_heads",
                 self.num_kv_heads)
        _require(self.sft_steps >= 0, "model.toy.sft_steps", ">= 0", self.sft_steps)


@dataclass
class ModelConfig:
    """The policy."""

    path: str = ""
    """Local HF checkpoint directory (config, safetensors, tokenizer). Empty: build the toy model."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype used for compute: bfloat16 on GPU (FSDP2 mixed precision, fp32 master weights and
    fp32 gradient reduction); float32 on CPU."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """transformers attention backend of the policy."""
    gradient_checkpointing: bool = False
    """Recompute decoder-block activations in backward (activation checkpointing)."""
    toy: ToyModelConfig = field(default_factory=ToyModelConfig)
    """The built-in toy model (used when `path` is empty)."""


@dataclass
class ToyTaskConfig:
    """The built-in verifiable task: small-integer arithmetic posed as a math problem."""

    num_train: int = 2000
    """Training problems generated."""
    num_val: int = 100
    """Validation problems (each distinct)."""
    held_out_val: bool = False
    """Validation problems never appear in training (tests generalization). False: validation samples
    the task's own problem set, i.e. measures how many of the task's facts the policy gets right."""
    verbose_fraction: float = 0.3
    """Fraction of warm-up responses that first restate the sum ('7+5=12' then 'Answer: 12'): with a
    short max response length they run into the limit, which gives overlong shaping something to do."""
    wrong_fraction: float = 0.6
    """Fraction of warm-up responses whose answer is a near miss (off by 1 or 2): the warmed-up model
    then knows the candidates but samples the right one only about 1 - wrong_fraction of the time,
    which is what RL sharpens."""
    max_operand: int = 9
    """Operands are drawn from 0..max_operand."""
    seed: int = 1234
    """Seed of the problem generator."""
    ops: str = "+"
    """Operations drawn from, any of '+', '-', '*' (e.g. "+-"); '-' problems never have a negative answer."""
    prompt_format: str = "Compute {expr}. End with Answer: N"
    """The user message; {expr} becomes e.g. '7+12' ({a}, {op}, {b} are also available)."""

    def __post_init__(self) -> None:
        _require(self.num_train >= 1, "data.toy.num_train", ">= 1", self.num_train)
        _require(self.num_val >= 0, "data.toy.num_val", ">= 0", self.num_val)
        _require(self.max_operand >= 1, "data.toy.max_operand", ">= 1", self.max_operand)
        _require(0 <= self.wrong_fraction <= 1, "data.toy.wrong_fraction", "a value in [0, 1]",
                 self.wrong_fraction)
        _require(0 <= self.verbose_fraction <= 1, "data.toy.verbose_fraction", "a value in [0, 1]",
                 self.verbose_fraction)
        _require(bool(self.ops) and set(self.ops) <= set("+-*") and len(set(self.ops)) == len(self.ops),
                 "data.toy.ops", "distinct characters among '+', '-', '*'", self.ops)
        try:
            self.prompt_format.format(expr="1+2", a=1, op="+", b=2)
            ok = "{expr}" in self.prompt_format or ("{a}" in self.prompt_format and "{b}" in self.prompt_format)
        except (KeyError, IndexError, ValueError):
            ok = False
        _require(ok, "data.toy.prompt_format", "a format string using {expr} (or {a} and {b}) and no other fields",
                 self.prompt_format)


@dataclass
class DataConfig:
    """Prompt datasets: parquet/jsonl in the DAPO-Math-17k schema, or plain {problem, answer} jsonl."""

    train_files: list[str] = field(default_factory=list)
    """Training files (.parquet or .jsonl). Empty: the built-in toy task."""
    val_files: list[str] = field(default_factory=list)
    """Validation files (same formats). Empty with empty train_files: the toy task's validation split."""
    max_prompt_length: int = 2048
    """Prompt token budget after the chat template."""
    truncation: Literal["left", "drop", "error"] = "left"
    """Prompts over max_prompt_length: keep the last tokens (DAPO), drop them (counted), or stop."""
    dedup: bool = False
    """Remove exact-duplicate prompts (the public DAPO-Math-17k file holds each problem ~100 times)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (deterministic for `trainer.seed`)."""
    toy: ToyTaskConfig = field(default_factory=ToyTaskConfig)
    """The built-in toy task (used when train_files is empty)."""

    def __post_init__(self) -> None:
        _require(self.max_prompt_length > 0, "data.max_prompt_length", "a positive integer", self.max_prompt_length)
        for name in ("train_files", "val_files"):
            for path in getattr(self, name):
                _require(str(path).endswith((".parquet", ".jsonl")), f"data.{name}", "*.parquet or *.jsonl", path)


@dataclass
class RolloutConfig:
    """Sampling responses from the policy."""

    engine: Literal["torch", "vllm"] = "torch"
    """torch: plain batched sampling with a KV cache (any device). vllm: co-located vLLM (GPU, extra `gpu`)."""
    n: int = 16
    """Responses per prompt (group size G)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer divides logits by the same value)."""
    top_p: float = 1.0
    """Nucleus sampling threshold during training (1.0 = off, as DAPO)."""
    top_k: int = -1
    """Top-k during training (-1 = off, as DAPO)."""
    max_response_length: int = 20480
    """Max new tokens per response (L_max of the overlong penalty)."""
    max_num_seqs: int = 256
    """torch engine: sequences decoded together (bounds its KV cache: max_num_seqs x (prompt + response)
    token slots). vLLM schedules its own batches."""
    val_n: int = 32
    """Samples per validation prompt (k of mean@k, pass@k, maj@k)."""
    val_temperature: float = 1.0
    """Validation sampling temperature (DAPO evaluates at 1.0)."""
    val_top_p: float = 0.7
    """Validation nucleus threshold (DAPO evaluates at 0.7)."""
    tensor_parallel_size: int = 1
    """vLLM tensor-parallel size; contiguous ranks form a group; world size must be divisible by it."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take for weights and KV cache."""
    max_num_batched_tokens: int = 8192
    """vLLM scheduler token budget per iteration."""
    sleep_level: Literal[1, 2] = 2
    """vLLM sleep level while training: 2 discards the weights (every weight is pushed before generating),
    1 offloads them to CPU memory and copies them back."""
    logprob_check_every: int = 10
    """Compare vLLM's and the trainer's log-probs on the same tokens every N steps (0 = only at start)."""
    logprob_check_threshold: float = 0.05
    """Warn when the mean |logp_vllm - logp_trainer| exceeds this."""

    def __post_init__(self) -> None:
        _require(self.n >= 1, "rollout.n", ">= 1", self.n)
        for name in ("temperature", "val_temperature"):
            _require(getattr(self, name) > 0, f"rollout.{name}", "> 0", getattr(self, name))
        for name in ("top_p", "val_top_p"):
            _require(0 < getattr(self, name) <= 1, f"rollout.{name}", "a value in (0, 1]", getattr(self, name))
        _require(self.top_k == -1 or self.top_k > 0, "rollout.top_k", "-1 (off) or a positive integer", self.top_k)
        _require(self.max_response_length > 0, "rollout.max_response_length", "a positive integer",
                 self.max_response_length)
        _require(self.val_n >= 1, "rollout.val_n", ">= 1", self.val_n)
        _require(self.max_num_seqs >= 1, "rollout.max_num_seqs", ">= 1", self.max_num_seqs)
        _require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", ">= 1", self.tensor_parallel_size)
        _require(0 < self.gpu_memory_utilization < 1, "rollout.gpu_memory_utilization", "a value in (0, 1)",
                 self.gpu_memory_utilization)
        _require(self.max_num_batched_tokens >= 1, "rollout.max_num_batched_tokens", ">= 1",
                 self.max_num_batched_tokens)
        _require(self.logprob_check_every >= 0, "rollout.logprob_check_every", ">= 0", self.logprob_check_every)
        _require(self.logprob_check_threshold > 0, "rollout.logprob_check_threshold", "> 0",
                 self.logprob_check_threshold)


@dataclass
class AlgorithmConfig:
    """DAPO (DAPO.md sections 1-3). Defaults are the paper's and the released recipe's values."""

    clip_low: float = 0.2
    """epsilon_low: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.28
    """epsilon_high (Clip-Higher): the ratio is clipped above at 1 + clip_high."""
    clip_ratio_c: float | None = 10.0
    """Dual-clip bound c for negative advantages (released recipe: 10.0); None disables it."""
    advantage_eps: float = 1e-6
    """epsilon in (R - mean) / (std + epsilon); std is unbiased."""
    dynamic_sampling: bool = True
    """Keep only groups whose accuracies are not all equal, refilling until train_batch prompts."""
    max_gen_batches: int = 10
    """Generation rounds allowed per step when refilling (<= 0: unbounded)."""
    on_max_gen_batches: Literal["error", "continue"] = "error"
    """When the bound is hit: stop with an error (released recipe) or train on the groups found so far."""
    overlong_buffer: bool = True
    """Soft overlong punishment added to the correctness reward."""
    overlong_buffer_len: int = 4096
    """L_cache: the penalty ramps from 0 to -factor over the last L_cache tokens before max length."""
    overlong_penalty_factor: float = 1.0
    """Multiplier of the overlong penalty."""
    overlong_filter: bool = False
    """Mask the loss of truncated responses (paper ablation; off in the released recipe)."""
    verifier: Literal["dapo", "math_verify"] = "dapo"
    """dapo: the released 'Answer:' rule with Minerva normalization. math_verify: equivalence checking
    with the math-verify package (extra `math`)."""

    def __post_init__(self) -> None:
        _require(0 <= self.clip_low < 1, "algorithm.clip_low", "a value in [0, 1)", self.clip_low)
        _require(self.clip_high >= 0, "algorithm.clip_high", ">= 0", self.clip_high)
        _require(self.clip_ratio_c is None or self.clip_ratio_c > 1, "algorithm.clip_ratio_c", "None or > 1",
                 self.clip_ratio_c)
        _require(self.advantage_eps > 0, "algorithm.advantage_eps", "> 0", self.advantage_eps)
        _require(self.overlong_buffer_len >= 1, "algorithm.overlong_buffer_len", ">= 1", self.overlong_buffer_len)
        _require(self.overlong_penalty_factor >= 0, "algorithm.overlong_penalty_factor", ">= 0",
                 self.overlong_penalty_factor)


@dataclass
class OptimConfig:
    """AdamW with linear warmup then a constant learning rate."""

    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Max global gradient norm (<= 0 disables clipping)."""
    warmup_steps: int = 10
    """Optimizer steps of linear warmup from 0 to lr, then constant."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, "optim.lr", "> 0", self.lr)
        _require(all(0 <= b < 1 for b in self.betas), "optim.betas", "two values in [0, 1)", self.betas)
        _require(self.weight_decay >= 0, "optim.weight_decay", ">= 0", self.weight_decay)
        _require(self.warmup_steps >= 0, "optim.warmup_steps", ">= 0", self.warmup_steps)


@dataclass
class TrainerConfig:
    """Batch geometry, schedule, devices and parallelism."""

    total_steps: int = 100
    """Training steps (each: rollouts of train_batch prompts, then train_batch/mini_batch optimizer steps)."""
    train_batch: int = 512
    """Prompts kept per step after dynamic sampling (all ranks together)."""
    gen_batch: int = 1536
    """Prompts sampled per generation round (all ranks together)."""
    mini_batch: int = 32
    """Prompts per optimizer step; train_batch / mini_batch optimizer steps per training step."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    micro_batch_tokens: int = 22528
    """Token budget of one forward/backward micro-batch on one rank: real tokens when packed
    (flash_attention_2), rows x longest row when padded (SDPA / eager)."""
    kernel_impl: Literal["auto", "naive", "torch", "triton"] = "auto"
    """Log-prob/loss implementation (auto: triton on CUDA, chunked torch elsewhere)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available."""
    seed: int = 0
    """Seed of data order, sampling and initialization."""
    val_every: int = 5
    """Validate every N steps (0 = never), plus before training and at the end."""
    val_before_train: bool = True
    """Validate once before the first step."""
    fsdp_cpu_offload: bool = False
    """FSDP2 CPU offload of parameters, gradients and optimizer state (released 32B recipe)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3) rather than keep them until backward."""

    def __post_init__(self) -> None:
        for name in ("total_steps", "train_batch", "gen_batch", "mini_batch", "ppo_epochs", "micro_batch_tokens"):
            _require(getattr(self, name) >= 1, f"trainer.{name}", ">= 1", getattr(self, name))
        _require(self.train_batch % self.mini_batch == 0, "trainer.mini_batch", f"a divisor of train_batch "
                 f"({self.train_batch})", self.mini_batch)
        _require(self.val_every >= 0, "trainer.val_every", ">= 0", self.val_every)


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (torch.distributed.checkpoint) and the final HF export."""

    save_every: int = 5
    """Save every N steps (0 = only at the end)."""
    keep_last: int = 3
    """Complete checkpoints kept on disk (older ones are deleted)."""
    resume: str = ""
    """'' starts fresh; 'auto' resumes from the newest complete checkpoint in the run directory (fresh if
    none); a path resumes from that checkpoint."""
    export_hf: bool = True
    """Write an HF-format export (safetensors, config, tokenizer) of the final policy."""

    def __post_init__(self) -> None:
        _require(self.save_every >= 0, "checkpoint.save_every", ">= 0", self.save_every)
        _require(self.keep_last >= 1, "checkpoint.keep_last", ">= 1", self.keep_last)


@dataclass
class LoggingConfig:
    """Run directory, console output and metric sinks."""

    run_dir: str = "runs/flashdapo"
    """Directory of this run: config, metrics.jsonl, plot, checkpoints, export."""
    plot: bool = True
    """Write training_dynamics.png (the curves of the paper's Fig. 7) at every validation and at the end."""
    tensorboard: bool = False
    """Also log to TensorBoard (needs the tensorboard package)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package)."""
    wandb_project: str = "flashdapo"
    """W&B project name."""
    progress: bool = True
    """Print one line per step (rank 0)."""


@dataclass
class Config:
    """flashdapo: DAPO reinforcement learning of reasoning LLMs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _require(self.algorithm.overlong_buffer_len <= self.rollout.max_response_length,
                 "algorithm.overlong_buffer_len", f"<= rollout.max_response_length ({self.rollout.max_response_length})",
                 self.algorithm.overlong_buffer_len)
        _require(self.rollout.engine == "torch" or bool(self.model.path), "rollout.engine",
                 "'torch' for the built-in toy model (vLLM needs model.path)", self.rollout.engine)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(_yaml_safe(self.to_dict()), sort_keys=False)


def _yaml_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _yaml_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_safe(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------------
# Loading from a file (YAML or JSON: the output of `flashdapo config`), with unknown keys named.


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict; unknown keys raise ConfigError naming them."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{prefix or 'config'}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        sub = _dataclass_type(cls, name)
        if sub is not None:
            kwargs[name] = from_dict(sub, value, f"{prefix}{name}.")
        elif name == "betas":
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def _dataclass_type(cls: type, name: str) -> type | None:
    default = {f.name: f for f in dataclasses.fields(cls)}[name].default_factory
    return default if isinstance(default, type) and dataclasses.is_dataclass(default) else None


def merge(base: Any, overrides: dict[str, Any], prefix: str = "") -> Any:
    """`base` with the (nested) `overrides` applied; validation runs again on every rebuilt level."""
    known = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"{prefix or 'config'}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    changes = {}
    for name, value in overrides.items():
        current = getattr(base, name)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            changes[name] = merge(current, value, f"{prefix}{name}.")
        else:
            changes[name] = tuple(value) if name == "betas" else value
    return dataclasses.replace(base, **changes)


def load_file(path: str | Path, base: Config) -> Config:
    """Apply a YAML/JSON config file (full or partial) on top of `base`."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read the file ({err.strerror})") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path}: not valid YAML/JSON: {err}") from err
    try:
        return merge(base, data or {})
    except ConfigError as err:
        raise ConfigError(f"--config {path}: {err}") from err


# ---------------------------------------------------------------------------------------------------
# Presets: functions returning a full Config. `toy` is the default.


def toy() -> Config:
    """CPU, minutes: a tiny Qwen2-style model learns the built-in arithmetic task with full DAPO."""
    return Config(
        # 'Answer: 18' + EOS is 6 tokens: free up to 6, penalized over 7..10, truncated (-1 more) beyond.
        rollout=RolloutConfig(n=8, max_response_length=10, val_n=4),
        algorithm=AlgorithmConfig(overlong_buffer_len=4, max_gen_batches=4, on_max_gen_batches="continue"),
        optim=OptimConfig(lr=5e-4, weight_decay=0.0, warmup_steps=2),
        trainer=TrainerConfig(total_steps=240, train_batch=32, gen_batch=48, mini_batch=4,
                              micro_batch_tokens=4096, val_every=20),
        checkpoint=CheckpointConfig(save_every=50, keep_last=2),
        logging=LoggingConfig(run_dir="runs/toy"),
    )


def qwen25_7b_math() -> Config:
    """Qwen2.5-7B (base) on DAPO-Math-17k, one 8-GPU node (80 GB each), co-located vLLM.

    Memory reasoning in docs/vllm.md. Qwen2.5-Math-7B would need max_response_length <= 2048: its
    config allows 4096 positions, which vLLM enforces.
    """
    return Config(
        model=ModelConfig(path="checkpoints/Qwen2.5-7B", dtype="bfloat16", gradient_checkpointing=True),
        data=DataConfig(train_files=["data/dapo-math-17k.parquet"], val_files=["data/aime-2024.parquet"],
                        max_prompt_length=2048, dedup=True),
        rollout=RolloutConfig(engine="vllm", n=16, max_response_length=8192, tensor_parallel_size=1,
                              gpu_memory_utilization=0.5, max_num_batched_tokens=16384, sleep_level=2),
        algorithm=AlgorithmConfig(overlong_buffer_len=2048),
        optim=OptimConfig(lr=1e-6, weight_decay=0.1, warmup_steps=10),
        trainer=TrainerConfig(total_steps=300, train_batch=128, gen_batch=384, mini_batch=16,
                              micro_batch_tokens=16384, val_every=10),
        checkpoint=CheckpointConfig(save_every=10, keep_last=3),
        logging=LoggingConfig(run_dir="runs/qwen2.5-7b-math"),
    )


def qwen25_32b_dapo() -> Config:
    """The released DAPO recipe for Qwen2.5-32B (DAPO.md section 6), on 16 nodes x 8 GPUs.

    Not reproduced by flashdapo: the recipe's sequence parallelism of 8 (Ulysses).
    """
    return Config(
        model=ModelConfig(path="checkpoints/Qwen2.5-32B", dtype="bfloat16", gradient_checkpointing=True),
        data=DataConfig(train_files=["data/dapo-math-17k.parquet"], val_files=["data/aime-2024.parquet"],
                        max_prompt_length=2048, truncation="left"),
        rollout=RolloutConfig(engine="vllm", n=16, temperature=1.0, top_p=1.0, top_k=-1,
                              max_response_length=20480, val_n=32, val_temperature=1.0, val_top_p=0.7,
                              tensor_parallel_size=4, gpu_memory_utilization=0.7,
                              max_num_batched_tokens=22528),
        algorithm=AlgorithmConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=10.0, dynamic_sampling=True,
                                  max_gen_batches=10, on_max_gen_batches="error", overlong_buffer=True,
                                  overlong_buffer_len=4096, overlong_penalty_factor=1.0, overlong_filter=False),
        optim=OptimConfig(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.1, grad_clip=1.0, warmup_steps=10),
        trainer=TrainerConfig(total_steps=400, train_batch=512, gen_batch=1536, mini_batch=32, ppo_epochs=1,
                              micro_batch_tokens=22528, val_every=5, fsdp_cpu_offload=True),
        checkpoint=CheckpointConfig(save_every=5),
        logging=LoggingConfig(run_dir="runs/qwen2.5-32b-dapo"),
    )


PRESETS: dict[str, Callable[[], Config]] = {
    "toy": toy,
    "qwen2.5-7b-math": qwen25_7b_math,
    "qwen2.5-32b-dapo": qwen25_32b_dapo,
}
DEFAULT_PRESET = "toy"


def preset(name: str) -> Config:
    """The named preset; unknown names list the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()

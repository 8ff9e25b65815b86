"""THE config tree of flashdapo: one set of dataclasses; the CLI, the YAML files and the presets derive from
it.

This module is the root, `Config`; its sections live by theme: inputs.py (`model`, `data`), sampling.py
(`rollout`, `algorithm`), lora.py (`lora`), training.py (`optim`, `trainer`, `checkpoint`, `logging`),
profiling.py (`profile`). Every field has its
default in its section's class and nowhere else, and states what it accepts in its type
(`Annotated[int, ge(1)]`; see checks.py); building a section checks it. The CLI
(`flashdapo train --help`) is generated from these dataclasses and their field docstrings by tyro.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .checks import Rule, Section, register_tree
from .engines import engine_spec
from .inputs import DataConfig, ModelConfig, ScratchpadTaskConfig, ToyModelConfig, ToyTaskConfig
from .lora import LoraConfig
from .profiling import ProfileConfig
from .sampling import AlgorithmConfig, RolloutConfig
from .training import CheckpointConfig, LoggingConfig, OptimConfig, TrainerConfig


def batch_invariant_gap(c) -> str | None:
    """What of `c` trainer.batch_invariant cannot cover (the setting, and why), None: nothing."""
    if c.rollout.engine not in ("torch", "vllm"):
        return f"rollout.engine {c.rollout.engine} (batch invariance is built for the torch and vllm engines)"
    if c.rollout.engine == "vllm" and c.rollout.tensor_parallel_size > 1:
        return ("rollout.tensor_parallel_size > 1 with rollout.engine vllm (the sampled log-prob's kernel "
                "reads the whole LM head)")
    if c.rollout.engine == "vllm" and c.lora.enabled:
        return "lora with rollout.engine vllm (vLLM's LoRA kernels are not matched by the trainer's forward)"
    if c.rollout.engine == "vllm" and not c.trainer.pack_sequences:
        return "trainer.pack_sequences false with rollout.engine vllm (its matching forward runs packed rows)"
    if c.rollout.top_p < 1.0 or c.rollout.top_k > 0:
        return ("rollout.top_p/top_k filters (the engine's log-probs are then renormalized over the kept "
                "tokens, not the trainer's)")
    if c.trainer.kernel_impl == "naive":
        return "trainer.kernel_impl naive (the invariant LM head is the chunked kernels')"
    if c.trainer.sequence_parallel > 1:
        return "trainer.sequence_parallel > 1 (not covered yet)"
    if c.algorithm.old_logprobs == "rollout" and c.rollout.streaming:
        return ("rollout.streaming and algorithm.old_logprobs rollout (carried tokens were sampled by older "
                "weights)")
    if c.algorithm.old_logprobs == "rollout" and c.rollout.placement == "split" and c.rollout.max_lag > 0:
        return "split placement at rollout.max_lag > 0 and algorithm.old_logprobs rollout (older weights)"
    return None


@dataclass
class Config(Section):
    """flashdapo: DAPO reinforcement learning of reasoning LLMs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    RULES = (
        Rule("algorithm.overlong_buffer_len",
             lambda c: c.algorithm.overlong_buffer_len <= c.rollout.max_response_length,
             lambda c: f"<= rollout.max_response_length ({c.rollout.max_response_length})"),
        Rule("rollout.engine",
             lambda c: not engine_spec(c.rollout.engine).needs_checkpoint or bool(c.model.path),
             lambda c: f"'torch' for the built-in toy model ({c.rollout.engine} needs model.path)"),
        Rule(
            "algorithm.rollout_correction", lambda c: c.algorithm.rollout_correction in
            ("auto", "none") or c.algorithm.old_logprobs == "recompute",
            lambda c: "'auto' or 'none' with algorithm.old_logprobs=rollout (pi_old is then the engine's own "
            "log-probs: every ratio of the correction is 1)"),
        Rule(
            "algorithm.routing_replay", lambda c: c.algorithm.routing_replay == "off" or
            (engine_spec(c.rollout.engine).records_routes and
             (not c.rollout.streaming or engine_spec(c.rollout.engine).streams_routes)),
            lambda c: f"off with rollout.engine={c.rollout.engine}"
            f"{' and rollout.streaming' if c.rollout.streaming else ''} (that engine does not record the "
            f"experts it routes to{' in a stream' if c.rollout.streaming else ''})"),
        # Without dynamic sampling every generated group trains: generating more would be thrown away.
        Rule(
            "trainer.gen_batch",
            lambda c: c.algorithm.dynamic_sampling or c.trainer.gen_batch == c.trainer.train_batch, lambda c:
            f"trainer.train_batch ({c.trainer.train_batch}) when algorithm.dynamic_sampling is false"),
        Rule("profile.steps", lambda c: all(s <= c.trainer.total_steps for s in c.profile.steps),
             lambda c: f"steps of the run, 1..trainer.total_steps ({c.trainer.total_steps})"),
        # trainer.batch_invariant: where the engine's log-probs cannot be the trainer's bits
        Rule("trainer.batch_invariant",
             lambda c: not c.trainer.batch_invariant or batch_invariant_gap(c) is None,
             lambda c: f"false with {batch_invariant_gap(c)}"),
    )

    @property
    def peak_lr(self) -> float:
        """The optimizer's peak learning rate: optim.lr, times lora.lr_scale when adapters train."""
        return self.optim.lr * (self.lora.lr_scale if self.lora.enabled else 1.0)

    def to_dict(self) -> dict[str, Any]:
        """The tree as nested dicts (tuples become lists)."""
        return _plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        """The tree as YAML, loadable with `--config`."""
        import yaml  # here, not at import: the GPU check's image has no yaml and never writes a config

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


register_tree(Config)


__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "Config", "DataConfig", "LoggingConfig", "LoraConfig",
    "ModelConfig",
    "OptimConfig", "ProfileConfig", "RolloutConfig", "ScratchpadTaskConfig", "ToyModelConfig",
    "ToyTaskConfig", "TrainerConfig"
]

"""The collector: where a training step's kept groups come from, one protocol for every placement and mode.

`train_step` calls `collect` and then trains on what it returns, without knowing where the groups came from:

- `RoundsCollector` (co-located, rollout.streaming=false): wake the engine on the current weights, generation
  rounds until train_batch informative groups are kept (rounds.py), sleep;
- `StreamingCollector` (co-located, rollout.streaming=true): the same around one stream that stops at enough,
  carrying what runs past into the next step (streaming.py); its state is saved with every checkpoint;
- split placement's receiver (trainer/split/trainer_side.py): wait for the rollout side's batch, and push the
  new weights after the update.

Each times its own stages (weight_sync, gen, reward, wait_batch, weight_push) in the step's timer and reports
its own metrics (stream/*, split/*).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...config import Config
from ...data import PromptSampler
from ...distributed.mesh import DistEnv
from ...profiling import StageTimer
from ...reward import RandomReward, Verifier
from ...rollout import RolloutEngine
from ...sync import WeightSource
from ..batch import TrainBatch
from .rounds import Collected, collect_groups
from .streaming import StreamState, StreamStats, stream_groups, stream_metrics


class Collector(Protocol):
    """Where a step's kept groups come from (module docstring)."""

    past_target: str
    """What a dump calls a kept group past train_batch: "next_step" (it trains next step) or "unused"."""

    def begin(self, start_step: int) -> None:
        """Before the first step of this process (after setup or resume)."""

    def collect(self, step: int, timer: StageTimer, keep_generated: bool = False) -> Collected:
        """This rank's share of step `step`'s kept groups, dealt into mini-batches. `keep_generated`: also
        every generated group (Collected.generated) for the rollout dump."""

    def after_update(self, step: int, timer: StageTimer) -> None:
        """After the step's update (the new weights exist)."""

    def metrics(self, step: int, batch: TrainBatch, timer: StageTimer) -> dict[str, float]:
        """The collector's own metrics of the step (global over ranks)."""

    def rank_state(self) -> dict[str, Any] | None:
        """This rank's state to save with a checkpoint (plain containers), None when it has none."""


@dataclass
class Sampling:
    """What a co-located collector samples with: the engine woken on the trainer's current weights, the
    prompts, and the reward."""

    engine: RolloutEngine
    weights: WeightSource
    """The policy's current weights, which the engine is woken on before it samples (sync/)."""
    sampler: PromptSampler
    tokenizer: Any
    reward: Callable[[], Verifier | RandomReward]
    """What judges training's responses, read at each step (the run's verifier, or the random reward)."""
    cfg: Config
    env: DistEnv


@dataclass
class RoundsCollector:
    """Co-located generation rounds (rounds.py)."""

    sampling: Sampling
    past_target: str = "unused"

    def begin(self, start_step: int) -> None:
        pass

    def collect(self, step: int, timer: StageTimer, keep_generated: bool = False) -> Collected:
        s = self.sampling
        with timer("weight_sync"):
            s.weights.wake(s.engine)
        collected = collect_groups(step, s.sampler, s.engine, s.tokenizer, s.reward(), s.cfg, s.env, timer,
                                   keep_generated=keep_generated)
        s.engine.sleep()
        return collected

    def after_update(self, step: int, timer: StageTimer) -> None:
        pass

    def metrics(self, step: int, batch: TrainBatch, timer: StageTimer) -> dict[str, float]:
        return {}

    def rank_state(self) -> dict[str, Any] | None:
        return None


@dataclass
class StreamingCollector:
    """Co-located streaming dynamic sampling (streaming.py): `state` carries work across steps and
    checkpoints."""

    sampling: Sampling
    state: StreamState = field(default_factory=StreamState)
    past_target: str = "next_step"
    stats: StreamStats | None = None
    """The last step's stream figures (for its metrics)."""

    def begin(self, start_step: int) -> None:
        pass

    def collect(self, step: int, timer: StageTimer, keep_generated: bool = False) -> Collected:
        s = self.sampling
        with timer("weight_sync"):
            s.weights.wake(s.engine)
        # The policy version sampling this step is the step itself: tokens' lags count from it.
        collected, self.stats = stream_groups(step, self.state, s.sampler, s.engine, s.tokenizer, s.reward(),
                                              s.cfg, s.env, timer, version=step,
                                              keep_generated=keep_generated)
        s.engine.sleep()
        return collected

    def after_update(self, step: int, timer: StageTimer) -> None:
        pass

    def metrics(self, step: int, batch: TrainBatch, timer: StageTimer) -> dict[str, float]:
        return stream_metrics(self.stats, batch, step, self.sampling.env)

    def rank_state(self) -> dict[str, Any] | None:
        return self.state.to_plain()


__all__ = ["Collector", "RoundsCollector", "Sampling", "StreamingCollector"]

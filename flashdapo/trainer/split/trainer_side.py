"""The trainer side of split placement: receive batch s, deal it over the T data-parallel slots, train as
co-located, push θ_s when a later batch needs it. Every wait for the rollout side polls the store
(`roles.Bridges.wait_key`): a long generation trips no collective timeout.

Per step it logs split/* metrics: the lag of every trained token (mean, max, histogram), the trainer's idle
fraction (waiting for the batch, over the step) and the rollout side's (waiting for weights, over its batch),
the weight push's seconds and bytes, the batch transfer's seconds and bytes, and the most versions the
rollout side held staged.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...config import Config
from ...distributed.collectives import all_reduce, broadcast_object
from ...distributed.mesh import DistEnv
from ...profiling import StageTimer
from ...sync.broadcast import PushStats, push_weights
from ...sync.check import PushCheck
from ..batch import TrainBatch
from ..collect.dealing import deal_to_slots
from ..collect.rounds import Collected
from ..collect.streaming import StreamStats, per_lag_metrics, stream_metrics
from .cut import read_boundary, read_queue
from .schedule import START_KEY, last_pushed_step
from .wire import BatchMessage, ready_key, unpack

LAG_BINS = 4
"""split/lag_hist_<j> for j < LAG_BINS, and one bin for every lag >= LAG_BINS."""


@dataclass
class SplitTrainer:
    """The trainer side of split placement: the run's collector (collect/collector.py) when
    rollout.placement=split. Its batches come from the rollout side; its weights go back to it."""

    env: DistEnv
    cfg: Config
    policy: Any
    check: PushCheck
    start: int = 0
    last_push: PushStats = field(default_factory=PushStats)
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    waited_s: float = 0.0
    queued: dict[int, bytes] = field(default_factory=dict)
    """Resumed: the batches the checkpoint's cut queued (trainer rank 0), trained before any is received."""
    queue_end: int = 0
    """Resumed: the last queued batch (every trainer rank; 0: none)."""
    message: BatchMessage | None = None
    """The last batch received (for its step's metrics)."""
    stream: StreamStats | None = None
    """The last batch's stream figures (rollout.streaming), else None."""
    past_target: str = "unused"
    run_id: str = ""
    """The run's id, written into each rollout part of its cuts (cut.py)."""
    cut_from: str = ""
    """Resumed: the run dir holding the cut's parts (the checkpoint's, also when resumed into another dir)."""

    @property
    def total_steps(self) -> int:
        return self.cfg.trainer.total_steps

    @property
    def max_lag(self) -> int:
        return self.cfg.rollout.max_lag

    def collect(self, step: int, timer: StageTimer, keep_generated: bool = False) -> Collected:
        """Batch `step` from the rollout side (the step's wait_batch stage); nothing generated here to
        dump."""
        with timer("wait_batch"):
            collected, self.stream, self.message = self.receive(step)
        return collected

    def after_update(self, step: int, timer: StageTimer) -> None:
        with timer("weight_push"):
            self.after_step(step)

    def rank_state(self) -> dict[str, Any] | None:
        return None  # the rollout side saves its own state: the cut's parts (cut.py)

    def resume(self, run_dir, start: int) -> None:
        """Take the queued batches of the cut of `start` (resumed runs, before `begin`)."""
        self.queue_end, self.cut_from = min(read_boundary(run_dir, start), self.total_steps), str(run_dir)
        if self.env.rank == 0:
            self.queued = dict(zip(range(start + 1, self.queue_end + 1), read_queue(run_dir, start)))

    def begin(self, start: int) -> None:
        """Tell the rollout side where the run starts, and push the starting weights (every trainer rank)."""
        self.start = start
        boundary = max(self.queue_end, start)
        if self.env.rank == 0:
            self.env.bridges.set(START_KEY, json.dumps({"start": start, "total": self.total_steps,
                                                        "resume": self.queue_end > 0, "boundary": boundary,
                                                        "run_id": self.run_id, "cut_dir": self.cut_from}))
        # θ(start) only when the rollout side generates a batch: a cut within max_lag of the end queued every
        # batch left, and the rollout side then ends at once, its weights receiver never started.
        if boundary < self.total_steps:
            self.last_push = push_weights(self.policy, self.env, start, self.check)

    def after_step(self, step: int) -> None:
        """Push θ_step if a batch of the schedule will sample it."""
        if step <= last_pushed_step(self.total_steps, self.max_lag, self.start) and step > self.start:
            self.last_push = push_weights(self.policy, self.env, step, self.check)
        else:
            self.last_push = PushStats()

    def receive(self, step: int) -> tuple[Collected, StreamStats | None, BatchMessage]:
        """Batch `step` from the rollout side, dealt to this rank's slot as the co-located collector deals
        it."""
        env, bridges, cfg = self.env, self.env.bridges, self.cfg
        rollout_ranks = list(range(bridges.layout.trainers, bridges.layout.world_size))
        queued = step <= self.queue_end
        self.waited_s = 0.0 if queued else bridges.wait_key(ready_key(step), rollout_ranks, f"batch {step}")
        began = time.perf_counter()
        payload = None
        if env.rank == 0:
            payload = (self.queued.pop(step) if queued else
                       bridges.recv_bytes(src=bridges.layout.trainers, tag=step, what=f"batch {step}"))
        payload = broadcast_object(payload)  # the bytes are here already: a short collective
        if env.rank == 0 and not queued:
            bridges.delete(ready_key(step))
        message = unpack(payload)
        self.transfer_s, self.transfer_bytes = time.perf_counter() - began, len(payload)
        dealt = deal_to_slots(message.groups, cfg.trainer.mini_batch, env.dp_size, env.dp_rank,
                              cfg.algorithm.advantage_eps)
        return dataclasses.replace(message.collected, mini_batches=dealt), message.stream, message

    def metrics(self, step: int, batch: TrainBatch, timer: StageTimer) -> dict[str, float]:
        """stream/* (rollout.streaming) and split/* metrics of the step (global over the trainer side)."""
        stream = stream_metrics(self.stream, batch, step, self.env) if self.stream is not None else {}
        return {**stream, **self.split_metrics(step, batch, self.message, timer)}

    def split_metrics(self, step: int, batch: TrainBatch, message: BatchMessage,
                      timer: StageTimer) -> dict[str, float]:
        """split/* metrics of the step (global over the trainer side)."""
        lags = torch.cat([step - v for g in batch.groups for v in (g.versions or [])] or
                         [torch.zeros(0, dtype=torch.long)])
        speaks = float(self.env.sp_rank == 0)  # the sp ranks of a slot hold the same responses
        bins = torch.bincount(lags.clamp(max=LAG_BINS), minlength=LAG_BINS + 1).double() * speaks
        sums = all_reduce(torch.cat([bins, torch.tensor([lags.sum().item() * speaks], dtype=torch.float64)]))
        peak = int(all_reduce(torch.tensor([int(lags.max()) if lags.numel() else -1]), "max").item())
        low = int(all_reduce(torch.tensor([int(lags.min()) if lags.numel() else 1 << 30]), "min").item())
        tokens = sums[:-1].sum().item()
        fresh = message.weights_step + 1  # the version tag of this batch's own groups (streaming's numbering)
        older = sum(1 for g in batch.groups for v in (g.versions or []) if len(v) and int(v.min()) < fresh)
        older = all_reduce(torch.tensor([older * speaks], dtype=torch.float64)).item()
        r = message.rollout
        step_s = max(timer.seconds.get("step", 0.0), 1e-9)
        rollout_s = max(r.busy_s + r.wait_weights_s, 1e-9)
        histogram = {f"split/lag_hist_{j}{'+' if j == LAG_BINS else ''}": sums[j].item()
                     for j in range(LAG_BINS + 1)}
        out = {
            "split/lag_mean": sums[-1].item() / max(tokens, 1.0), "split/lag_max": float(peak),
            "split/lag_min": float(low) if tokens else -1.0, "split/trained_tokens": tokens, **histogram,
            "split/weights_step": float(message.weights_step), "split/older_responses": older,
            "split/trainer_idle": self.waited_s / step_s, "split/rollout_idle": r.wait_weights_s / rollout_s,
            "split/weight_push_s": self.last_push.seconds,
            "split/weight_push_bytes": float(self.last_push.bytes), "split/batch_transfer_s": self.transfer_s,
            "split/batch_bytes": float(self.transfer_bytes), "split/staged_max": r.staged_max,
            "split/push_check_max": r.push_check_max, "timing_s/rollout_gen": r.gen_s,
            "timing_s/rollout_reward": r.reward_s, "timing_s/rollout_wait_weights": r.wait_weights_s,
            "timing_s/rollout_load": r.load_s
        }
        # The correction's mean weight and the engine/trainer k3 KL, for lag 0 and lag >= 1 tokens.
        out.update(
            {k.replace("stream/", "split/"): v
             for k, v in per_lag_metrics(batch, lags, speaks).items()})
        return out


__all__ = ["LAG_BINS", "SplitTrainer"]

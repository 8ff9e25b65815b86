"""The trainer side of split placement: receive batch s, deal it over the T data-parallel slots, train as
co-located, push θ_s when a later batch needs it. Every wait for the rollout side polls the store
(`roles.Bridges.wait_key`): a long generation trips no collective timeout.

Per step it logs split/* metrics: the lag of every trained token (mean, max, histogram), the trainer's idle
fraction (waiting for the batch, over the step) and the rollout side's (waiting for weights, over its batch),
the weight push's seconds and bytes, the batch transfer's seconds and bytes, and the most versions the
rollout side held staged.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from ...distributed.collectives import all_reduce, broadcast_object
from ...distributed.mesh import DistEnv
from ...profiling import StageTimer
from ..batch import TrainBatch
from ..collect.dealing import deal_to_slots
from ..collect.rounds import Collected
from ..collect.streaming import StreamStats, _per_lag
from ..observe.logprob_check import PushCheck
from .cut import read_boundary, read_queue
from .schedule import START_KEY, last_pushed_step
from .weights import PushStats, push_weights
from .wire import BatchMessage, ready_key, unpack

LAG_BINS = 4
"""split/lag_hist_<j> for j < LAG_BINS, and one bin for every lag >= LAG_BINS."""


@dataclass
class SplitTrainer:
    """Trainer-side state of split placement, held by the Run."""

    env: DistEnv
    max_lag: int
    total_steps: int
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

    def resume(self, run_dir, start: int) -> None:
        """Take the queued batches of the cut of `start` (resumed runs, before `begin`)."""
        self.queue_end = min(read_boundary(run_dir, start), self.total_steps)
        if self.env.rank == 0:
            self.queued = dict(zip(range(start + 1, self.queue_end + 1), read_queue(run_dir, start)))

    def begin(self, policy, start: int) -> None:
        """Tell the rollout side where the run starts, and push the starting weights (every trainer rank)."""
        self.start = start
        if self.env.rank == 0:
            self.env.bridges.set(START_KEY, json.dumps({"start": start, "total": self.total_steps,
                                                        "resume": self.queue_end > 0,
                                                        "boundary": max(self.queue_end, start)}))
        if start < self.total_steps:
            self.last_push = push_weights(policy, self.env, start, self.check)

    def after_step(self, policy, step: int) -> None:
        """Push θ_step if a batch of the schedule will sample it."""
        if step <= last_pushed_step(self.total_steps, self.max_lag, self.start) and step > self.start:
            self.last_push = push_weights(policy, self.env, step, self.check)
        else:
            self.last_push = PushStats()

    def receive(self, step: int, cfg) -> tuple[Collected, StreamStats | None, BatchMessage]:
        """Batch `step` from the rollout side, dealt to this rank's slot as the co-located collector deals it."""
        env, bridges = self.env, self.env.bridges
        rollout_ranks = list(range(bridges.layout.trainers, bridges.layout.world_size))
        queued = step <= self.queue_end
        self.waited_s = 0.0 if queued else bridges.wait_key(ready_key(step), rollout_ranks, f"batch {step}")
        began = time.perf_counter()
        payload = None
        if env.rank == 0:
            payload = self.queued.pop(step) if queued else bridges.recv_bytes(src=bridges.layout.trainers, tag=step)
        payload = broadcast_object(payload)  # the bytes are here already: a short collective
        if env.rank == 0 and not queued:
            bridges.delete(ready_key(step))
        message = unpack(payload)
        self.transfer_s, self.transfer_bytes = time.perf_counter() - began, len(payload)
        c = message.collected
        collected = Collected(
            mini_batches=deal_to_slots(message.groups, cfg.trainer.mini_batch, env.dp_size, env.dp_rank,
                                       cfg.algorithm.advantage_eps),
            num_gen_batches=int(c["num_gen_batches"]), groups_generated=int(c["groups_generated"]),
            groups_informative=int(c["groups_informative"]), gen_acc=c["gen_acc"], gen_score=c["gen_score"],
            gen_truncated=c["gen_truncated"], groups_all_equal=int(c["groups_all_equal"]),
            groups_all_correct=int(c["groups_all_correct"]), groups_all_wrong=int(c["groups_all_wrong"]),
            generated_samples=int(c["generated_samples"]), generated_tokens=int(c["generated_tokens"]))
        stream = StreamStats(**message.stream) if message.stream is not None else None
        return collected, stream, message

    def metrics(self, step: int, batch: TrainBatch, message: BatchMessage, timer: StageTimer) -> dict[str, float]:
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
        rollout_s = max(r["busy_s"] + r["wait_weights_s"], 1e-9)
        out = {"split/lag_mean": sums[-1].item() / max(tokens, 1.0), "split/lag_max": float(peak),
               "split/lag_min": float(low) if tokens else -1.0, "split/trained_tokens": tokens,
               **{f"split/lag_hist_{j}{'+' if j == LAG_BINS else ''}": sums[j].item() for j in range(LAG_BINS + 1)},
               "split/weights_step": float(message.weights_step), "split/older_responses": older,
               "split/trainer_idle": self.waited_s / step_s, "split/rollout_idle": r["wait_weights_s"] / rollout_s,
               "split/weight_push_s": self.last_push.seconds, "split/weight_push_bytes": float(self.last_push.bytes),
               "split/batch_transfer_s": self.transfer_s, "split/batch_bytes": float(self.transfer_bytes),
               "split/staged_max": r["staged_max"], "split/push_check_max": r["push_check_max"],
               "timing_s/rollout_gen": r["gen_s"], "timing_s/rollout_reward": r["reward_s"],
               "timing_s/rollout_wait_weights": r["wait_weights_s"], "timing_s/rollout_load": r["load_s"]}
        # The correction's mean weight and the engine/trainer k3 KL, for lag 0 and lag >= 1 tokens.
        out.update({k.replace("stream/", "split/"): v for k, v in _per_lag(batch, lags, speaks).items()})
        return out


__all__ = ["LAG_BINS", "SplitTrainer"]

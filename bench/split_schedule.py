"""The two halves of the simulated split-placement schedule (bench/split_sim.py): what the engines generate
per batch, and when each side runs under the strict lag rule.

Nothing here is measured. The engine side reuses bench/longtail_model.py's continuous-batching Instance
(roofline decode, compute-bound prefill, KV-cache admission and preemption); this module adds the batch
boundary (dynamic sampling with or without partial-rollout carry) and per-token provenance (which batch
sampled each trained token). The schedule side is a discrete-event simulation: events in a heap, the
trainer's queue of complete batches, the rollout side's staged weight versions, and the rule that batch b
is generated with the weights of step b - 1 - k, no fresher and no older (the rollout side waits for that
version; it never loads another).

The engine's lengths do not depend on the weights in this model, so a run's batches are generated once
and the schedule replays them at every lag k: only their start times differ.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from bench.longtail_model import GPU_BYTES, KEPT, MEM_UTIL, Instance, Setup, draw_lengths

MAX_CARRY = 1
"""rollout.max_carry_steps: a response is carried at most once; stopped again, it restarts from scratch."""


@dataclass(frozen=True)
class EngineSetup(Setup):
    """longtail_model's Setup with the engine's memory utilization as a field (split rollout GPUs hold no
    trainer state, so they can give the KV cache more)."""

    mem_util: float = MEM_UTIL

    @property
    def kv_capacity(self) -> float:
        return (self.mem_util * GPU_BYTES * self.tp - 2 * self.model.params) / self.model.kv_bytes


@dataclass(frozen=True)
class Collection:
    """How a batch is collected: lognormal lengths (mean, sigma of the log), informative fraction, carry."""

    mean: float
    sigma: float
    carry: bool
    kept: float = KEPT


@dataclass(frozen=True)
class RolloutBatch:
    """One batch as the engines produced it; token counts are for the whole cluster."""

    gen_s: float
    """Engine time of the batch: the slowest simulated instance."""
    lengths: np.ndarray
    """Trained response lengths of the simulated instances."""
    scale: float
    """Copies of `lengths` that make the cluster's train_batch groups."""
    sources: dict[int, float]
    """Trained tokens by the batch whose weights sampled them."""
    generated: float
    reprefilled: float
    """Tokens prefilled again: carried prefixes and preempted rows."""
    carried: float
    """Responses stopped at this batch's end and resubmitted in the next with their tokens."""
    restarted: float
    """Responses stopped at this batch's end a second time: their tokens are discarded, they start again."""


class _Counted(Instance):
    """Instance that counts the tokens it prefills a second time (a carried or preempted row's prefix)."""

    reprefilled = 0

    def admit(self, step: int) -> None:
        before = len(self.running)
        super().admit(step)
        self.reprefilled += int(self.done[self.running[before:]].sum())


class InstanceStream:
    """One engine instance's share of the collection, batch after batch (module docstring)."""

    def __init__(self, setup: EngineSetup, collection: Collection, in_flight: int, target: int,
                 rng: np.random.Generator) -> None:
        self.inst, self.col, self.rng = _Counted(setup), collection, rng
        self.in_flight, self.target = in_flight, target
        self.left: dict[int, int] = {}
        """Pending groups: responses still to finish."""
        self.informative: dict[int, bool] = {}
        self.ready: list[int] = []
        """Informative groups finished past the last target (carry: they open the next batch)."""
        self.first = np.zeros(0, dtype=np.int64)
        """Per request: the batch of its oldest kept token (-1: none)."""
        self.history: dict[int, np.ndarray] = {}
        """Batch -> tokens each request generated in it (all batches: a group whose member restarted can
        finish several batches after its first tokens)."""
        self.next_group = 0

    def _top_up(self) -> None:
        n = self.inst.setup.n
        while len(self.left) < self.in_flight:
            self.inst.add(draw_lengths(self.rng, n, self.col.mean, self.col.sigma), self.next_group)
            self.left[self.next_group] = n
            self.informative[self.next_group] = bool(self.rng.random() < self.col.kept)
            self.next_group += 1

    def _step(self, batch: int) -> list[int]:
        """Admit, decode to the next finish; the informative groups that completed."""
        self.inst.admit(batch)
        done = []
        for g in self.inst.group[self.inst.advance()].tolist():
            self.left[g] -= 1
            if self.left[g] == 0:
                del self.left[g]
                if self.informative.pop(g):
                    done.append(g)
        return done

    def _unfinished(self) -> np.ndarray:
        inst = self.inst
        return np.array(sorted([*inst.running.tolist(), *inst.waiting]), dtype=np.int64)

    def _rounds(self, b: int) -> list[int]:
        """The recipe's rounds: in_flight prompts at once, each round waits for its last response, until the
        target's informative groups are complete; the ones past it are discarded (the recipe trims)."""
        kept: list[int] = []
        while len(kept) < self.target:
            self._top_up()
            while self.left:
                kept += self._step(b)
        return sorted(kept)[:self.target]  # in prompt order, as the recipe trims, not in completion order

    def _stream(self, b: int) -> list[int]:
        """Streaming with carry (rollout.streaming, partial_rollouts): prompts topped up as groups finish until
        the target's informative groups are complete; informative groups past it open the next batch."""
        kept, self.ready = self.ready, []
        while len(kept) < self.target:
            self._top_up()
            kept += self._step(b)
        self.ready = kept[self.target:]
        return kept[:self.target]

    def _cut(self, b: int) -> tuple[int, int]:
        """The end of a streamed batch: every unfinished response stops; the ones that started in this batch
        are carried (tokens kept, prefilled again next batch), the ones carried in already restart from
        scratch (rollout.max_carry_steps = MAX_CARRY). (carried, restarted)."""
        inst = self.inst
        pending = self._unfinished()
        partial = pending[inst.done[pending] > 0]
        stale = partial[self.first[partial] < b - MAX_CARRY + 1]
        inst.done[stale], self.first[stale] = 0, -1
        for h in self.history.values():
            h[stale[stale < len(h)]] = 0  # their tokens are discarded: no trained token comes from them
        inst.running, inst.waiting = np.zeros(0, dtype=np.int64), deque(pending.tolist())
        return len(partial) - len(stale), len(stale)

    def batch(self, b: int) -> tuple[float, np.ndarray, dict[int, int], int, int, int, int]:
        """Collect batch b: (engine seconds, trained responses' lengths, their tokens by the batch that sampled
        them, generated, re-prefilled, carried, restarted)."""
        inst = self.inst
        inst.clock, inst.generated, inst.reprefilled = 0.0, 0, 0
        start = inst.done.copy()
        kept = self._stream(b) if self.col.carry else self._rounds(b)
        grown = np.zeros(len(inst.done), dtype=np.int64)
        grown[:len(start)] = start
        self.history[b] = inst.done - grown
        first = np.full(len(inst.done), -1, dtype=np.int64)
        first[:len(self.first)] = self.first
        self.first = np.where((first < 0) & (self.history[b] > 0), b, first)
        carried, restarted = self._cut(b) if self.col.carry else (0, 0)
        ids = np.flatnonzero(np.isin(inst.group, kept))
        sources = {s: int(h[ids[ids < len(h)]].sum()) for s, h in self.history.items()}
        if sum(sources.values()) != int(inst.target[ids].sum()):
            raise AssertionError(f"batch {b}: trained tokens with no sampling batch")
        return inst.clock, inst.target[ids], sources, inst.generated, inst.reprefilled, carried, restarted


def generate_batches(setup: EngineSetup, collection: Collection, batches: int, seed: int,
                     simulated: int = 2) -> list[RolloutBatch]:
    """`batches` batches of the cluster's engines: `simulated` instances (of setup.instances), each with
    1/instances of the in-flight prompts and of the target, independent; the batch ends with the slowest."""
    instances = setup.instances
    in_flight, target = math.ceil(setup.gen_batch / instances), math.ceil(setup.train_batch / instances)
    shown = min(simulated, instances)
    streams = [InstanceStream(setup, collection, in_flight, target, np.random.default_rng([seed, i]))
               for i in range(shown)]
    scale = setup.train_batch / (target * shown)
    """Trained groups of the cluster per simulated trained group (the target was rounded up)."""
    out = []
    for b in range(1, batches + 1):
        parts = [s.batch(b) for s in streams]
        sources: dict[int, float] = {}
        for part in parts:
            for src, tokens in part[2].items():
                sources[src] = sources.get(src, 0.0) + tokens * scale
        per_instance = instances / shown
        out.append(RolloutBatch(
            gen_s=max(p[0] for p in parts), lengths=np.concatenate([p[1] for p in parts]), scale=scale,
            sources={s: t for s, t in sources.items() if t}, generated=sum(p[3] for p in parts) * per_instance,
            reprefilled=sum(p[4] for p in parts) * per_instance, carried=sum(p[5] for p in parts) * per_instance,
            restarted=sum(p[6] for p in parts) * per_instance))
    return out


@dataclass(frozen=True)
class PhaseCosts:
    """Seconds of each phase, per batch where it varies."""

    gen_s: list[float]
    train_s: list[float]
    load_s: float
    """Rollout side: the staged weights into the engine, before a batch."""
    push_s: float
    """Trainer side: gather and send the new weights, after a step."""
    transfer_s: list[float]
    """A finished batch to the trainer."""
    wake_s: float = 0.0
    sleep_s: float = 0.0
    """Co-located only: the engine wakes before and sleeps after its batch, on the same GPUs."""


@dataclass
class Trace:
    """What the schedule did: busy intervals of each side, each batch's weight version, step ends."""

    k: int
    colocated: bool
    rollout: list[tuple[float, float]] = field(default_factory=list)
    trainer: list[tuple[float, float]] = field(default_factory=list)
    version: dict[int, int] = field(default_factory=dict)
    """Batch -> the weight version (trainer step) that generated it."""
    step_end: dict[int, float] = field(default_factory=dict)
    max_queued: int = 0
    max_staged: int = 0
    """Most weight versions received by the rollout side and not yet loaded."""


def run_schedule(costs: PhaseCosts, k: int, colocated: bool) -> Trace:
    """The event simulation (module docstring). Co-located: one pool of GPUs, so a side starts only when the
    other is idle, and k must be 0."""
    if colocated and k != 0:
        raise ValueError(f"max_lag: co-located placement is synchronous (k = 0), got {k}")
    n, trace = len(costs.gen_s), Trace(k, colocated)
    events: list[tuple[float, int, str, int]] = []
    order = itertools.count()
    staged, queue = {0}, deque()
    free = {"rollout": True, "trainer": True}
    nxt = {"batch": 1, "step": 1}

    def post(t: float, kind: str, x: int) -> None:
        heapq.heappush(events, (t, next(order), kind, x))

    def try_rollout(t: float) -> None:
        b = nxt["batch"]
        if b > n or not free["rollout"] or (colocated and not free["trainer"]):
            return
        v = max(0, b - 1 - k)
        if v not in staged:  # the lag rule: wait for exactly this version
            return
        staged.difference_update({u for u in staged if u < v})  # older ones are never asked for again
        trace.version[b] = v
        end = t + costs.wake_s + costs.load_s + costs.gen_s[b - 1] + costs.sleep_s
        trace.rollout.append((t, end))
        free["rollout"], nxt["batch"] = False, b + 1
        post(end, "rollout_done", b)

    def try_train(t: float) -> None:
        s = nxt["step"]
        if not free["trainer"] or not queue or queue[0] != s or (colocated and not free["rollout"]):
            return
        queue.popleft()
        end = t + costs.train_s[s - 1] + costs.push_s
        trace.trainer.append((t, end))
        free["trainer"], nxt["step"] = False, s + 1
        post(end, "train_done", s)

    try_rollout(0.0)
    while events:
        t, _, kind, x = heapq.heappop(events)
        if kind == "rollout_done":
            free["rollout"] = True
            post(t + costs.transfer_s[x - 1], "batch_arrived", x)
        elif kind == "batch_arrived":
            queue.append(x)
            trace.max_queued = max(trace.max_queued, len(queue))
        elif kind == "train_done":
            free["trainer"], trace.step_end[x] = True, t
            staged.add(x)
            waiting = sum(u > trace.version[nxt["batch"] - 1] for u in staged) if nxt["batch"] <= n else 0
            trace.max_staged = max(trace.max_staged, waiting)
            if waiting > k + 1:
                raise AssertionError(f"step {x}: {waiting} weight versions staged, more than k + 1")
        try_train(t)
        try_rollout(t)
    if len(trace.step_end) != n:
        raise AssertionError(f"schedule stalled after {len(trace.step_end)} of {n} steps")
    return trace

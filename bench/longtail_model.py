"""A model of the released DAPO recipe's step time on H20 nodes, with rounds and with streaming (modelled).

Nothing here is measured: every figure it prints is modelled, from these inputs.

- **Hardware** (NVIDIA H20): 4.0 TB/s HBM, 148 TFLOP/s dense bf16, 96 GB per GPU.
- **Recipe** (docs/algorithm.md, section 6): 512 prompts trained per step, generation batch 1536, 16
  responses each, responses up to 20480 tokens, vLLM at gpu_memory_utilization 0.7. Qwen2.5-32B on 128 GPUs
  with tensor parallelism 4 (the recipe's cluster); Qwen2.5-7B on 32 GPUs with tensor parallelism 1.
  max_num_seqs 1024 (vLLM's default for GPUs of >= 70 GiB, vllm/engine/arg_utils.py).
- **Response lengths**: lognormal, capped at 20480 (a capped response is truncated). Its mean follows the
  paper's Fig. 7 (the mean response length grows from about 700 to about 4.5k tokens over the run); its
  spread (sigma of the log, 1.0) is an assumption: at a mean of 4.5k it truncates ~2% of the responses.
  Prompts are 200 tokens (an assumption; DAPO-Math-17k's templated prompts are of that order).
- **Dynamic sampling**: a group is informative with probability 0.5 (an assumption), independent of its
  lengths; with gen_batch = 3 x train_batch one round suffices.
- **Decode** (one engine instance, tp GPUs): a step of B running rows holding C context tokens takes the
  roofline time max((weights + C x KV bytes per token) / (tp x HBM), (2 x params x B + 4 x layers x hidden x C)
  / (tp x FLOP/s)). A prefill (a prompt, or a carried response's prompt + prefix) is compute-bound:
  (2 x params x tokens + 2 x layers x hidden x tokens^2) / (tp x FLOP/s). Rows are admitted first come first
  served while the KV cache (0.7 x 96 GB x tp minus the weights) has room; a row that no longer fits is
  preempted (the newest first) and re-prefilled when it is readmitted, as vLLM does.
- **Training**: old log-probs (forward) and the update (forward and backward) over the trained responses,
  8 x params x tokens + 8 x layers x hidden x sum(length^2) FLOPs at 35% of the cluster's peak (an
  assumption). Weight sync and the rest of the step are left out.

One instance stands for all: it gets 1/instances of the generation batch, of the in-flight prompts and of the
target (the all-reduce that stops the stream is left out). Rounds: every round's requests are submitted at
once and the round ends with its last response. Streaming: at most gen_batch / instances prompts in flight,
topped up as groups finish; the step stops once train_batch / instances informative groups finished; with
carry the running responses keep their tokens, resume next step (prompt + prefix prefilled) and restart when
more than one step old; without carry they and their groups are dropped. Streaming figures are the mean of
steps 4-8 of a simulated run (the carry reaches its steady state).

    python -m bench.longtail_model                # the table (markdown) on stdout
"""

from __future__ import annotations

import argparse
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

HBM_BYTES_S = 4.0e12
FLOPS = 148e12
GPU_BYTES = 96e9
MEM_UTIL = 0.7
TRAIN_MFU = 0.35
PROMPT = 200
MAX_LEN = 20480
MAX_NUM_SEQS = 1024
KEPT = 0.5
SIGMA = 1.0
PAPER_MEANS = (700, 2500, 4500)
"""Mean response lengths modelled: early, middle and late in the paper's run (Fig. 7)."""


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int = 128

    @property
    def kv_bytes(self) -> float:
        """bf16 K and V of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class Setup:
    model: Model
    gpus: int
    tp: int
    train_batch: int = 512
    gen_batch: int = 1536
    n: int = 16

    @property
    def instances(self) -> int:
        return self.gpus // self.tp

    @property
    def kv_capacity(self) -> float:
        """KV-cache tokens of one instance."""
        return (MEM_UTIL * GPU_BYTES * self.tp - 2 * self.model.params) / self.model.kv_bytes


SETUPS = (Setup(Model("Qwen2.5-7B", 7.62e9, 28, 3584, 4), gpus=32, tp=1),
          Setup(Model("Qwen2.5-32B", 32.8e9, 64, 5120, 8), gpus=128, tp=4))


def decode_s(s: Setup, rows: int, context: float) -> float:
    m = s.model
    memory = (2 * m.params + context * m.kv_bytes) / (s.tp * HBM_BYTES_S)
    compute = (2 * m.params * rows + 4 * m.layers * m.hidden * context) / (s.tp * FLOPS)
    return max(memory, compute)


def prefill_s(s: Setup, tokens: np.ndarray) -> float:
    m = s.model
    return float((2 * m.params * tokens.sum() + 2 * m.layers * m.hidden * (tokens.astype(float) ** 2).sum())
                 / (s.tp * FLOPS))


def train_s(s: Setup, lengths: np.ndarray, copies: int = 1) -> float:
    """Old log-probs and the update over the step's trained responses (with their prompts): `lengths` taken
    `copies` times (an instance's share stands for the batch with copies = instances)."""
    m = s.model
    seq = lengths.astype(float) + PROMPT
    flops = (8 * m.params * seq.sum() + 8 * m.layers * m.hidden * (seq ** 2).sum()) * copies
    return flops / (s.gpus * FLOPS * TRAIN_MFU)


def draw_lengths(rng: np.random.Generator, count: int, mean: float, sigma: float) -> np.ndarray:
    mu = math.log(mean) - sigma ** 2 / 2
    return np.minimum(np.maximum(np.round(rng.lognormal(mu, sigma, count)), 1), MAX_LEN).astype(np.int64)


class Instance:
    """One engine instance's continuous batching over a growing store of requests (module docstring)."""

    def __init__(self, setup: Setup) -> None:
        self.setup, self.clock, self.generated = setup, 0.0, 0
        self.target = np.zeros(0, dtype=np.int64)
        """Each request's drawn length (the tokens it will have when it finishes)."""
        self.done = np.zeros(0, dtype=np.int64)
        self.group = np.zeros(0, dtype=np.int64)
        self.started = np.zeros(0, dtype=np.int64)
        """The step whose weights sampled a request's oldest kept token (-1: none)."""
        self.running = np.zeros(0, dtype=np.int64)
        """Request ids in the decode batch, oldest admission first."""
        self.waiting: deque[int] = deque()

    def add(self, lengths: np.ndarray, group: int) -> None:
        first = len(self.target)
        self.target = np.concatenate([self.target, lengths])
        self.done = np.concatenate([self.done, np.zeros(len(lengths), dtype=np.int64)])
        self.group = np.concatenate([self.group, np.full(len(lengths), group)])
        self.started = np.concatenate([self.started, np.full(len(lengths), -1)])
        self.waiting.extend(range(first, first + len(lengths)))

    def admit(self, step: int) -> None:
        """First come first served while the KV cache has room; each admission costs its prefill."""
        used = float((self.done[self.running] + PROMPT).sum())
        joined = []
        while self.waiting and len(self.running) + len(joined) < MAX_NUM_SEQS:
            need = PROMPT + int(self.done[self.waiting[0]])
            if used + need + 1 > self.setup.kv_capacity:
                break
            joined.append(self.waiting.popleft())
            used += need
        if joined:
            ids = np.array(joined)
            self.clock += prefill_s(self.setup, self.done[ids] + PROMPT)
            self.started[ids] = np.where(self.started[ids] < 0, step, self.started[ids])
            self.running = np.concatenate([self.running, ids])

    def advance(self) -> np.ndarray:
        """Decode until the next row finishes (or the cache fills); the ids that finished."""
        ids = self.running
        if not len(ids):
            return ids
        rows, ctx = len(ids), float((self.done[ids] + PROMPT).sum())
        room = int((self.setup.kv_capacity - ctx) // rows)
        ticks = max(1, min(int((self.target[ids] - self.done[ids]).min()), room))
        self.clock += sum_decode_s(self.setup, rows, ctx, ticks)
        self.done[ids] += ticks
        self.generated += ticks * rows
        over = self.done[ids] >= self.target[ids]
        self.running = ids[~over]
        fits = np.cumsum(self.done[self.running] + PROMPT) <= self.setup.kv_capacity
        if not fits.all():  # preempt the newest rows until the rest fits; they wait at the front
            self.waiting.extendleft(reversed(self.running[~fits].tolist()))
            self.running = self.running[fits]
        return ids[over]

    def drain(self, step: int) -> None:
        while self.waiting or len(self.running):
            self.admit(step)
            self.advance()


def sum_decode_s(s: Setup, rows: int, context: float, ticks: int) -> float:
    """`ticks` decode steps of `rows` rows from `context` cached tokens (each step adds a token per row)."""
    contexts = context + rows * np.arange(ticks)
    m = s.model
    memory = (2 * m.params + contexts * m.kv_bytes) / (s.tp * HBM_BYTES_S)
    compute = (2 * m.params * rows + 4 * m.layers * m.hidden * contexts) / (s.tp * FLOPS)
    return float(np.maximum(memory, compute).sum())


@dataclass
class StepFigures:
    gen_s: float
    train_s: float
    trained_mean: float
    generated_per_trained: float

    @property
    def step_s(self) -> float:
        return self.gen_s + self.train_s


def rounds_step(s: Setup, mean: float, sigma: float, rng: np.random.Generator) -> StepFigures:
    """One round on every instance (1536 prompts; 512 informative groups train): the round ends with the
    last instance's last response."""
    prompts, keep = s.gen_batch // s.instances, s.train_batch // s.instances
    clocks, kept, generated = [], [], 0
    for _ in range(s.instances):
        inst = Instance(s)
        lengths = draw_lengths(rng, prompts * s.n, mean, sigma)
        for g in range(prompts):
            inst.add(lengths[g * s.n:(g + 1) * s.n], g)
        inst.drain(1)
        clocks.append(inst.clock)
        generated += inst.generated
        kept.append(lengths[: keep * s.n])  # informative groups are independent of their lengths
    rounds = math.ceil(s.train_batch / (s.gen_batch * KEPT))
    trained = np.concatenate(kept)
    return StepFigures(max(clocks) * rounds, train_s(s, trained), float(trained.mean()),
                       generated * rounds / float(trained.sum()))


def stream_run(s: Setup, mean: float, sigma: float, carry: bool, rng: np.random.Generator,
               steps: int = 8) -> list[StepFigures]:
    """A streaming run on one instance (1/instances of the in-flight prompts and of the target)."""
    in_flight, target = s.gen_batch // s.instances, s.train_batch // s.instances
    inst, out = Instance(s), []
    left: dict[int, int] = {}
    """Pending groups: responses still to finish."""
    informative: dict[int, bool] = {}
    ready: list[int] = []
    """Informative groups finished past the last step's target: first in line."""
    next_group = 0
    for step in range(1, steps + 1):
        inst.clock, inst.generated = 0.0, 0
        kept, ready = ready, []
        pending = np.flatnonzero(np.isin(inst.group, list(left)) & (inst.done < inst.target))
        stale = pending[(inst.started[pending] >= 0) & (step - inst.started[pending] > 1)]
        inst.done[stale], inst.started[stale] = 0, -1  # more than one step old: restart
        inst.waiting = deque(pending.tolist())
        while len(kept) < target:
            while len(left) < in_flight:
                inst.add(draw_lengths(rng, s.n, mean, sigma), next_group)
                left[next_group], informative[next_group] = s.n, bool(rng.random() < KEPT)
                next_group += 1
            inst.admit(step)
            for g in inst.group[inst.advance()].tolist():
                left[g] -= 1
                if left[g] == 0:
                    del left[g]
                    if informative.pop(g):
                        kept.append(g)
        kept, ready = kept[:target], kept[target:]
        inst.running = np.zeros(0, dtype=np.int64)
        if not carry:  # the running responses and their groups are dropped
            left.clear()
        trained = inst.target[np.isin(inst.group, kept)]
        out.append(StepFigures(inst.clock, train_s(s, trained, s.instances), float(trained.mean()),
                               inst.generated / float(trained.sum())))
    return out


def row(s: Setup, mean: float, sigma: float, seed: int = 0) -> dict[str, StepFigures]:
    """Rounds, streaming + carry and streaming without carry at one mean length (steady-state steps)."""
    figures = {"rounds": rounds_step(s, mean, sigma, np.random.default_rng(seed))}
    for name, carry in (("carry", True), ("stop", False)):
        steps = stream_run(s, mean, sigma, carry, np.random.default_rng(seed + 1))[3:]
        figures[name] = StepFigures(*(float(np.mean([getattr(f, k) for f in steps]))
                                      for k in ("gen_s", "train_s", "trained_mean", "generated_per_trained")))
    return figures


def table(sigma: float = SIGMA, means: tuple[int, ...] = PAPER_MEANS) -> str:
    lines = ["| model | GPUs (tp) | mean length | rounds gen / step s | carry gen / step s | carry step / rounds "
             "| carry gen / rounds | no-carry step s | no-carry step / rounds | trained mean length: rounds, carry, "
             "no carry | generated / trained tokens: rounds, carry, no carry |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for s in SETUPS:
        for mean in means:
            f = row(s, mean, sigma)
            r, c, n = f["rounds"], f["carry"], f["stop"]
            lines.append(
                f"| {s.model.name} | {s.gpus} ({s.tp}) | {mean} | {r.gen_s:.0f} / {r.step_s:.0f} | "
                f"{c.gen_s:.0f} / {c.step_s:.0f} | {c.step_s / r.step_s:.2f} | {c.gen_s / r.gen_s:.2f} | "
                f"{n.step_s:.0f} | {n.step_s / r.step_s:.2f} | {r.trained_mean:.0f}, {c.trained_mean:.0f}, "
                f"{n.trained_mean:.0f} | {r.generated_per_trained:.2f}, {c.generated_per_trained:.2f}, "
                f"{n.generated_per_trained:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sigma", type=float, default=SIGMA, help="sigma of the log of the response length")
    args = parser.parse_args(argv)
    print(f"## Modelled: the released recipe on H20 (bench/longtail_model.py, sigma {args.sigma:g})\n")
    print("Every figure below is modelled (roofline decode, assumed length distribution), none measured.\n")
    print(table(args.sigma))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

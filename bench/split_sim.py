"""Simulated DAPO step schedule on H20 nodes: co-located vs split placement at a strict lag k.

Every figure this prints is **simulated** from the inputs below; none is measured. verl's measured figures
are printed beside them, labelled as such, for scale only (other recipe, other lengths).

- **Hardware** (NVIDIA H20, as bench/longtail_model.py): 4.0 TB/s HBM, 148 TFLOP/s dense bf16, 96 GB per GPU,
  8 GPUs a node. Weight gather inside the trainer at 450 GB/s (half the 900 GB/s NVLink figure; assumed),
  weights to the rollout nodes at 25 GB/s (one 200-400 Gb/s NIC's share; assumed), host <-> GPU at 25 GB/s
  (PCIe Gen5 x16 is 64 GB/s nominal; assumed), 3 s of fixed cost per engine sleep or wake (KV cache freed and
  re-allocated, CUDA graphs; assumed).
- **Models**: Qwen2.5-7B (tensor parallel 1) and Qwen2.5-32B (tensor parallel 4), shapes from their configs.
- **Recipe** (the released DAPO recipe, as longtail_model): 512 groups trained per step, at most 1536 prompts
  in flight, 16 responses each, 200-token prompts, responses up to 20480 tokens, max_num_seqs 1024.
- **Lengths**: lognormal, capped at 20480 (longtail_model.draw_lengths), mean 2500 tokens by default (the
  middle of the DAPO paper's Fig. 7 run, which grows from ~700 to ~4.5k) and sigma 1.0 of the log (assumed;
  ~0.5% of responses reach the cap, so every batch has a tail at the cap).
- **Dynamic sampling**: a group is informative with probability 0.5 (assumed), independent of its lengths.
  Without carry: the recipe's rounds of 1536 prompts, each waiting for its longest response, until 512
  informative groups are complete, trimmed to 512 in prompt order; every token's lag is then exactly k.
  With carry (flashdapo's rollout.streaming + partial_rollouts, max_carry_steps 1): prompts are topped up
  to 1536 in flight as groups finish, the batch stops at 512 informative groups, the responses still running
  are stopped and resubmitted in the next batch (prompt + prefix prefilled again under the new weights), a
  response stopped a second time restarts from scratch, and informative groups past 512 open the next
  batch. A group then spans batches, so its tokens' lag is k plus their age in batches.
- **Engines** (longtail_model.Instance): continuous batching with roofline decode, compute-bound prefill and
  vLLM-style preemption. Co-located at gpu_memory_utilization 0.7 (the recipe's), split rollout GPUs at 0.9
  (vLLM's default; they hold no trainer state). Two instances are simulated, each with 1/instances of the
  prompts and of the target; the batch ends with the slower.
- **Trainer**: old log-probs (2N FLOPs per token, forward) and the update (6N, forward and backward) plus
  attention, at 35% MFU of the trainer GPUs (assumed, as longtail_model; `--mfu`), linear in GPUs.
- **Co-located**: wake (weights back from host memory) + generate + sleep (weights to host) on all GPUs, then
  train on all GPUs and load the new weights into the engine over the gather path. Split: after each step
  the trainer gathers and sends the weights (it waits for that), the rollout side copies the staged version
  into its engines before a batch; a finished batch's tokens and log-probs reach the trainer over the NIC.
- **Sensitivity**: the page repeats the 7B table with every engine second / 0.4 (`--engine-efficiency` sets it
  for the main table): a real engine runs below the roofline (verl's measured 32-H20 generation is ~2.5x the
  roofline's figure for its lengths, an estimate), and the answer turns on the generation : training ratio.
- **Figures**: batches 1-10; s/step, idle fractions and overlap over steps 5-10 (after the pipeline and the
  carry fill). Overlap: the fraction of that time both sides are busy. Lag: per trained token, the trainer
  step minus one minus the version that sampled it (token-weighted mean; max).

    python -m bench.split_sim                       # the tables (markdown) on stdout
    make bench-split-sim                            # -> bench/results/<date>-simulated-h20-split.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.longtail_model import HBM_BYTES_S, SETUPS, SIGMA, TRAIN_MFU, Model, train_s
from bench.split_schedule import (
    Collection,
    EngineSetup,
    PhaseCosts,
    RolloutBatch,
    Trace,
    generate_batches,
    run_schedule,
)

GATHER_BYTES_S = 450e9
NIC_BYTES_S = 25e9
PCIE_BYTES_S = 25e9
SWITCH_FIXED_S = 3.0
COLOCATED_MEM_UTIL = 0.7
ROLLOUT_MEM_UTIL = 0.9
BATCH_BYTES_PER_TOKEN = 8
"""A generated token to the trainer: its id and its sampling log-prob (int32 + fp32)."""
MEAN = 2500
BATCHES, WARM = 10, 4
SEED = 0
GPU_COUNTS = {"Qwen2.5-7B": (32, 64, 128), "Qwen2.5-32B": (64, 128)}
"""32B from 64 GPUs (the recipe's cluster is 128; at 32, 8 rollout GPUs hold two TP4 engines)."""
RATIOS = ((1, 3), (1, 1), (3, 1))
LAGS = (0, 1, 2)
MODELS = tuple((s.model, s.tp) for s in SETUPS)
SLOW_ENGINE = 0.4
"""The sensitivity table's engine efficiency (see report)."""

VERL_MEASURED = (
    ("verl fully async, Qwen2.5-Math-7B DAPO (28K max response), 32 H20", "sync 790.1 s/step", "16:16 294.8 s/step",
     "2.66x over 400 steps"),
    ("same, 64 H20", "sync 365.3", "32:32 189.3", "1.92x"),
    ("same, 128 H20", "sync 356.3", "64:64 150.6 (staleness 0 / streaming only: 231.3)", "2.35x"),
    ("verl one-step-off, Qwen2.5-Math-7B DAPO (20,480), FSDP2, 16 H20", "749 s/step", "4 gen : 12 train, 520 s/step",
     "+23% total time"),
)
"""verl's published figures (docs/advance/fully_async.md and one_step_off.md in verl's repository)."""


@dataclass(frozen=True)
class Inputs:
    """The knobs of a simulated table."""

    mean: float = MEAN
    sigma: float = SIGMA
    mfu: float = TRAIN_MFU
    engine_efficiency: float = 1.0
    """Engines at this fraction of the roofline."""


@dataclass(frozen=True)
class Placement:
    """Co-located on `gpus` GPUs (rollout = 0), or split into `rollout` + `gpus - rollout`."""

    model: Model
    tp: int
    gpus: int
    rollout: int = 0
    train_batch: int = 512
    gen_batch: int = 1536
    n: int = 16

    @property
    def trainer(self) -> int:
        return self.gpus - self.rollout if self.rollout else self.gpus

    @property
    def label(self) -> str:
        return f"split {self.rollout}:{self.trainer}" if self.rollout else "co-located"


@dataclass(frozen=True)
class SimFigures:
    """One config's steady-state figures (module docstring); all simulated."""

    s_per_step: float
    gen_s: float
    train_s: float
    overlap: float
    trainer_idle: float
    rollout_idle: float
    lag_mean: float
    lag_max: int
    generated_per_trained: float
    reprefill_share: float
    """Tokens prefilled again per generated token."""
    trained_mean_length: float
    restarted_per_step: float
    """Responses stopped a second time and started again from scratch (carry only)."""


def engine_setup(p: Placement) -> EngineSetup:
    gpus = p.rollout or p.gpus
    util = ROLLOUT_MEM_UTIL if p.rollout else COLOCATED_MEM_UTIL
    return EngineSetup(p.model, gpus=gpus, tp=p.tp, train_batch=p.train_batch, gen_batch=p.gen_batch, n=p.n,
                       mem_util=util)


def phase_costs(p: Placement, batches: list[RolloutBatch], mfu: float, engine_efficiency: float = 1.0) -> PhaseCosts:
    """Seconds of every phase from bytes and FLOPs (module docstring); engine seconds / engine_efficiency."""
    weights = 2 * p.model.params
    trainer = EngineSetup(p.model, gpus=p.trainer, tp=p.tp)
    train = [train_s(trainer, b.lengths, b.scale) * TRAIN_MFU / mfu for b in batches]
    gather = weights / GATHER_BYTES_S
    gen = [b.gen_s / engine_efficiency for b in batches]
    if not p.rollout:
        switch = weights / p.tp / PCIE_BYTES_S + SWITCH_FIXED_S
        return PhaseCosts(gen_s=gen, train_s=train, load_s=0.0, push_s=gather,
                          transfer_s=[0.0] * len(batches), wake_s=switch, sleep_s=switch)
    return PhaseCosts(gen_s=gen, train_s=train, load_s=weights / p.tp / HBM_BYTES_S,
                      push_s=gather + weights / NIC_BYTES_S,
                      transfer_s=[b.generated * BATCH_BYTES_PER_TOKEN / NIC_BYTES_S for b in batches])


def _busy(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in xs for c, d in ys)


def token_lags(trace: Trace, batches: list[RolloutBatch], step: int) -> dict[int, float]:
    """Trained tokens of `step` by their lag: (step - 1) - the version of the batch that sampled them."""
    lags: dict[int, float] = {}
    for source, tokens in batches[step - 1].sources.items():
        lag = step - 1 - trace.version[source]
        lags[lag] = lags.get(lag, 0.0) + tokens
    return lags


def summarize(trace: Trace, batches: list[RolloutBatch], costs: PhaseCosts, warm: int = WARM) -> SimFigures:
    """Steady-state figures over steps warm+1 .. the last (module docstring)."""
    last = len(batches)
    lo, hi = trace.step_end[warm], trace.step_end[last]
    window = hi - lo
    rollout, trainer = _busy(trace.rollout, lo, hi), _busy(trace.trainer, lo, hi)
    steps = range(warm + 1, last + 1)
    lags = [token_lags(trace, batches, s) for s in steps]
    tokens = sum(sum(x.values()) for x in lags)
    trained = sum(float(batches[s - 1].lengths.sum()) * batches[s - 1].scale for s in steps)
    return SimFigures(
        s_per_step=window / len(steps),
        gen_s=sum(costs.gen_s[s - 1] for s in steps) / len(steps),
        train_s=sum(costs.train_s[s - 1] for s in steps) / len(steps),
        overlap=_intersection(rollout, trainer) / window,
        trainer_idle=max(0.0, 1 - _length(trainer) / window),
        rollout_idle=max(0.0, 1 - _length(rollout) / window),
        lag_mean=sum(lag * t for x in lags for lag, t in x.items()) / tokens,
        lag_max=max(lag for x in lags for lag in x),
        generated_per_trained=sum(batches[s - 1].generated for s in steps) / trained,
        reprefill_share=sum(batches[s - 1].reprefilled for s in steps) / sum(batches[s - 1].generated for s in steps),
        trained_mean_length=float(np.mean([batches[s - 1].lengths.mean() for s in steps])),
        restarted_per_step=sum(batches[s - 1].restarted for s in steps) / len(steps))


def simulate(p: Placement, collection: Collection, lags: tuple[int, ...], inputs: Inputs | None = None,
             seed: int = SEED, batches: int = BATCHES) -> dict[int, SimFigures]:
    """One placement's batches, generated once, scheduled at every lag (co-located: k = 0 only)."""
    inputs = inputs or Inputs()
    generated = generate_batches(engine_setup(p), collection, batches, seed)
    costs = phase_costs(p, generated, inputs.mfu, inputs.engine_efficiency)
    return {k: summarize(run_schedule(costs, k, colocated=not p.rollout), generated, costs)
            for k in (lags if p.rollout else (0,))}


def placements(model: Model, tp: int, gpus: int) -> list[Placement]:
    """Co-located, then each R : T ratio."""
    return [Placement(model, tp, gpus)] + [Placement(model, tp, gpus, gpus * r // (r + t)) for r, t in RATIOS]


HEADER = ["| model | GPUs | placement | k | carry | s/step | vs co-located | gen s/batch | train s/step | overlap | "
          "trainer idle | rollout idle | lag mean / max | generated / trained tokens | re-prefilled / generated | "
          "trained mean length | restarted / step |",
          "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]


def rows(model: Model, tp: int, gpus: int, carry: bool, inputs: Inputs, log=lambda line: None) -> list[str]:
    """The table rows of one (model, GPU count, carry): co-located first, every ratio and lag after it."""
    collection = Collection(inputs.mean, inputs.sigma, carry)
    out, base = [], None
    for p in placements(model, tp, gpus):
        for k, f in simulate(p, collection, LAGS, inputs).items():
            base = base or f.s_per_step
            out.append(f"| {model.name} | {gpus} | {p.label} | {k} | {'yes' if carry else 'no'} | {f.s_per_step:.0f} "
                       f"| {base / f.s_per_step:.2f}x | {f.gen_s:.0f} | {f.train_s:.0f} | {f.overlap:.2f} | "
                       f"{f.trainer_idle:.2f} | {f.rollout_idle:.2f} | {f.lag_mean:.2f} / {f.lag_max} | "
                       f"{f.generated_per_trained:.2f} | {f.reprefill_share:.3f} | {f.trained_mean_length:.0f} | "
                       f"{f.restarted_per_step:.0f} |")
            log(out[-1])
    return out


def _grid(inputs: Inputs, models, gpu_counts, log) -> list[str]:
    lines = list(HEADER)
    for model, tp in models:
        for gpus in gpu_counts[model.name]:
            for carry in (False, True):
                lines += rows(model, tp, gpus, carry, inputs, log)
    return lines


def _inputs_text() -> list[str]:
    """The module docstring's list of inputs and assumptions, as markdown."""
    body = __doc__.split("\n\n", 2)[2].split("\n\n    python -m")[0]
    return body.splitlines()


def report(inputs: Inputs, models=MODELS, gpu_counts=GPU_COUNTS, sensitivity: float | None = SLOW_ENGINE,
           log=lambda line: None) -> str:
    """The results page: inputs, the simulated tables, verl's measured figures."""
    lines = [f"# Simulated: DAPO step schedule on H20, co-located vs split placement ({datetime.date.today()})", "",
             "**Every figure in the tables below is simulated** by `python -m bench.split_sim` "
             "(bench/split_sim.py, bench/split_schedule.py), except the last table's, which verl measured. Inputs: "
             f"roofline decode (engines at {inputs.engine_efficiency:.0%} of it), lognormal lengths (mean "
             f"{inputs.mean:g}, sigma {inputs.sigma:g}, capped at 20480), informative fraction 0.5, trainer at "
             f"{inputs.mfu:.0%} MFU, seed {SEED}; the module docstring lists every input and assumption. "
             "`vs co-located`: the co-located s/step of the same model, GPU count and carry setting over this "
             "row's (above 1: split is faster).", "", "## Inputs (of the simulation)", "", *_inputs_text(), "",
             "## Simulated: roofline engines", "", *_grid(inputs, models, gpu_counts, log)]
    if sensitivity is not None:
        slow = dataclasses.replace(inputs, engine_efficiency=sensitivity)
        lines += ["", f"## Simulated: engines at {sensitivity:.0%} of the roofline (Qwen2.5-7B)", "",
                  f"Every engine second above multiplied by 1 / {sensitivity:.2f}: an estimate of how far a real "
                  "engine runs "
                  "below the roofline (verl's measured 32-H20 generation, 357 s, is ~2.5x what the roofline gives "
                  "for its lengths; an estimate, not a measurement of ours). Simulated.", "",
                  *_grid(slow, models[:1], gpu_counts, log)]
    lines += ["", "## Measured by verl (for scale; their recipe and lengths, not the simulated ones)", "",
              "| setup | co-located | split | speedup |", "|---|---|---|---|",
              *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in VERL_MEASURED), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mean", type=float, default=MEAN, help="mean response length (tokens)")
    parser.add_argument("--sigma", type=float, default=SIGMA, help="sigma of the log of the response length")
    parser.add_argument("--mfu", type=float, default=TRAIN_MFU, help="trainer model-FLOPs utilization")
    parser.add_argument("--engine-efficiency", type=float, default=1.0,
                        help="engines at this fraction of the roofline (every engine second / this)")
    parser.add_argument("--no-sensitivity", action="store_true", help="skip the slow-engine table")
    parser.add_argument("--out", default=None, help="write the page here too (a file path)")
    args = parser.parse_args(argv)
    inputs = Inputs(args.mean, args.sigma, args.mfu, args.engine_efficiency)
    text = report(inputs, sensitivity=None if args.no_sensitivity else SLOW_ENGINE,
                  log=lambda line: print(line, file=sys.stderr, flush=True))
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

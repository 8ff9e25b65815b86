"""What `flashdapo ablate` runs: the mechanism panels (the default; PANELS, below the ladder) and the paper's
cumulative ladder (`--ladder`).

The ladder: the arms of the paper's ablation (DAPO, Table 1), each adding one technique to the one before.
Order and definitions (docs/ablation.md, docs/algorithm.md):

| arm | adds | config |
|---|---|---|
| naive GRPO | (baseline) | clip 0.2 / 0.2, `seq-mean-token-mean`, no dynamic sampling, no overlong shaping |
| + overlong filtering | mask the loss of truncated responses | `overlong_filter` on |
| + Clip-Higher | decoupled clip, wider above | `clip_high` 0.28 |
| + soft overlong punishment | length penalty over the last L_cache tokens, replacing the filter |
`overlong_buffer` on, `overlong_filter` off |
| + token-level loss | average the loss over tokens, not sequences | `loss_agg_mode` `token-mean` |
| + dynamic sampling (DAPO) | drop all-equal groups and refill | `dynamic_sampling` on, `gen_batch` the base's
|

The paper's table writes each row as "+ X" on the row above; its final recipe (and the released one) uses
the soft punishment without the filter, so the soft-punishment arm swaps one for the other and the last
arm is the base config's full DAPO. Everything else (the dual clip c, learning rate, batch geometry) is
the base config's in every arm.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import Config, merge


@dataclass(frozen=True)
class Arm:
    """One rung of the ladder."""

    name: str
    """Directory and command-line name."""
    label: str
    """The paper's row name."""
    paper_aime: int
    """The paper's AIME 2024 avg@32 for this row (Table 1, Qwen2.5-32B)."""
    adds: dict[str, Any]
    """Dotted config fields this arm sets on top of the arm before (the first arm: on top of the base config).
    A value of `GEN_BATCH_OF_BASE` stands for the base config's trainer.gen_batch."""


GEN_BATCH_OF_BASE = "<base trainer.gen_batch>"
TRAIN_BATCH_OF_BASE = "<base trainer.train_batch>"

ARMS: tuple[Arm, ...] = (
    Arm(
        "naive-grpo", "naive GRPO", 30, {
            "algorithm.clip_low": 0.2, "algorithm.clip_high": 0.2,
            "algorithm.loss_agg_mode": "seq-mean-token-mean", "algorithm.dynamic_sampling": False,
            "trainer.gen_batch": TRAIN_BATCH_OF_BASE, "algorithm.overlong_buffer": False,
            "algorithm.overlong_filter": False
        }),
    Arm("overlong-filter", "+ overlong filtering", 36, {"algorithm.overlong_filter": True}),
    Arm("clip-higher", "+ Clip-Higher", 38, {"algorithm.clip_high": 0.28}),
    Arm("soft-overlong", "+ soft overlong punishment", 41,
        {"algorithm.overlong_buffer": True, "algorithm.overlong_filter": False}),
    Arm("token-level-loss", "+ token-level loss", 42, {"algorithm.loss_agg_mode": "token-mean"}),
    Arm("dynamic-sampling", "+ dynamic sampling (DAPO)", 50,
        {"algorithm.dynamic_sampling": True, "trainer.gen_batch": GEN_BATCH_OF_BASE}),
)
"""The ladder, in the paper's order."""

ARM_NAMES = tuple(arm.name for arm in ARMS)


def arm_fields(index: int, base: Config) -> dict[str, Any]:
    """Every dotted field arm `index` sets (its own and those of the arms before it), with the base's batch
    sizes filled in."""
    fields: dict[str, Any] = {}
    for arm in ARMS[:index + 1]:
        fields.update(arm.adds)
    stand_ins = {GEN_BATCH_OF_BASE: base.trainer.gen_batch, TRAIN_BATCH_OF_BASE: base.trainer.train_batch}
    return {k: stand_ins.get(v, v) if isinstance(v, str) else v for k, v in fields.items()}


def nested(fields: dict[str, Any]) -> dict[str, Any]:
    """Dotted fields as the nested mapping `merge` takes."""
    out: dict[str, Any] = {}
    for path, value in fields.items():
        *sections, leaf = path.split(".")
        node = out
        for s in sections:
            node = node.setdefault(s, {})
        node[leaf] = value
    return out


def arm_config(index: int, base: Config) -> Config:
    """The base config with arm `index`'s fields set (checked like any config)."""
    return merge(base, nested(arm_fields(index, base)))


def arm_index(name: str) -> int:
    return ARM_NAMES.index(name)


# ---------------------------------------------------------------------------------------------------
# The mechanism panels (the default of `flashdapo ablate`; docs/ablation.md).
#
# Each panel runs where its mechanism has something to act on: a control arm and one or more treatment arms,
# each treatment differing from the control in exactly one config field (tests/ablation/test_arms.py checks it
# on the built configs), every arm run for the same seeds (a seed fixes the data order and the sampling seeds,
# so arm A and arm B of seed s see the same prompts in the same order and draw from the same random streams).
# Each panel is judged by ONE metric, a function of a run's metrics history fixed here before any run; the
# report gives the per-seed paired differences treatment - control of that metric, their mean, 95% t interval
# and p-value, Holm's correction across all panels' comparisons, and the secondary metrics as per-arm means.
# ---------------------------------------------------------------------------------------------------

LAST_FRACTION = 0.25
"""'Over the last steps' means the records of the last quarter of the run's steps (step > 0.75
total_steps)."""
DEGENERATE_TRUNCATION, DEGENERATE_ACCURACY = 0.5, 0.02
"""A run degenerates when, over its last steps, more than half of its generated responses are truncated or its
training accuracy is below 0.02 (fixed before any run)."""


def _series(history: list[dict], key: str, last: int | None = None) -> list[tuple[float, float]]:
    """(step, value) of every training record holding `key` (step > 0), of the last `last` steps if given."""
    points = [(float(m["step"]), float(m[key])) for m in history if key in m and m.get("step", 0) > 0]
    if last is not None and points:
        end = max(s for s, _ in points)
        points = [(s, v) for s, v in points if s > end - last]
    return points


def last_steps(cfg: Config) -> int:
    """How many of the final steps "over the last steps" covers."""
    return max(1, round(cfg.trainer.total_steps * LAST_FRACTION))


def mean_over_last(key: str) -> Callable[[list[dict], Config], float | None]:
    """The mean of `key` over the last steps (LAST_FRACTION of the run); None when never logged."""
    def measure(history: list[dict], cfg: Config) -> float | None:
        points = _series(history, key, last_steps(cfg))
        return statistics.fmean(v for _, v in points) if points else None
    return measure


def mean_over_run(key: str) -> Callable[[list[dict], Config], float | None]:
    """The mean of `key` over every training step; None when never logged."""
    def measure(history: list[dict], cfg: Config) -> float | None:
        points = _series(history, key)
        return statistics.fmean(v for _, v in points) if points else None
    return measure


def slope_over_run(key: str) -> Callable[[list[dict], Config], float | None]:
    """The least-squares slope of `key` against the step (units per step); None with fewer than 2 points."""
    def measure(history: list[dict], cfg: Config) -> float | None:
        points = _series(history, key)
        if len(points) < 2:
            return None
        xs, ys = zip(*points)
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None
    return measure


VAL_MEAN = "val/acc/mean@k"
SAMPLES_CUM = "train/generated_samples_cum"


def sample_budget(cfg: Config) -> int:
    """The dynamic sampling panel's common generation budget: what a run without dynamic sampling generates
    over its steps (gen_batch = train_batch prompts x n responses a step)."""
    return cfg.trainer.total_steps * cfg.trainer.train_batch * cfg.rollout.n


def val_auc_per_sample(history: list[dict], cfg: Config) -> float | None:
    """Validation mean@k against samples generated for training, averaged over [0, sample_budget(cfg)]: the
    area under the piecewise-linear curve through the validations (step 0 at 0 samples), divided by the
    budget. A run that generates more per step reaches the budget in fewer steps; its curve is cut
    (interpolated) there. A curve that ends before the budget holds its last value. None without validations
    or the samples counter."""
    points = []
    for m in history:
        if VAL_MEAN in m:
            x = 0.0 if m.get("step", 0) == 0 else m.get(SAMPLES_CUM)
            if x is None:
                return None
            points.append((float(x), float(m[VAL_MEAN])))
    budget = float(sample_budget(cfg))
    points.sort()
    if not points or points[0][0] > 0.0:
        return None
    if points[-1][0] < budget:
        points.append((budget, points[-1][1]))
    area = 0.0
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 >= budget:
            break
        if x1 > budget:  # cut the segment at the budget
            y1 = y0 + (y1 - y0) * (budget - x0) / (x1 - x0)
            x1 = budget
        area += (x1 - x0) * (y0 + y1) / 2.0
    return area / budget


def degenerate(history: list[dict], cfg: Config) -> float | None:
    """1.0 when the run degenerated (DEGENERATE_TRUNCATION, DEGENERATE_ACCURACY over the last steps), else
    0.0."""
    truncated = mean_over_last("train/gen_truncated")(history, cfg)
    accuracy = mean_over_last("train/gen_acc")(history, cfg)
    if truncated is None or accuracy is None:
        return None
    return float(truncated > DEGENERATE_TRUNCATION or accuracy < DEGENERATE_ACCURACY)


@dataclass(frozen=True)
class Measure:
    """A named function of one run's metrics history (and its config): a panel's metric or a secondary one."""

    name: str
    """What it is, as the report's tables name it."""
    key: str
    """The logged metric it reads, drawn over steps in the panel's picture."""
    compute: Callable[[list[dict], Config], float | None]
    """The value for one run; None when the run did not log what it needs."""
    x: str = "step"
    """What the picture draws `key` against: the step, or another logged counter."""


@dataclass(frozen=True, eq=False)  # identity: the panels are module constants, used as keys
class PanelArm:
    """One arm of a panel: the control, or a treatment changing exactly one field of the control."""

    name: str
    label: str
    change: dict[str, Any] = field(default_factory=dict)
    """The one dotted field (and its value) this arm changes from the panel's control; {} for the control."""


@dataclass(frozen=True, eq=False)
class Panel:
    """A mechanism test: a control and treatments on panel-wide settings, judged by a metric fixed in
    advance."""

    name: str
    title: str
    figure: str
    """The paper's figure this panel mirrors, and what it shows there."""
    settings: dict[str, Any]
    """Dotted fields every arm of this panel sets on top of the base config (its regime)."""
    arms: tuple[PanelArm, ...]
    """The control first, then the treatments."""
    metric: Measure
    expected: str
    """The direction the paper (or the cited literature) predicts for treatment - control."""
    secondary: tuple[Measure, ...] = ()
    quick_arms: tuple[str, ...] = ()
    """The arms `--quick` runs (none: the panel is not in the quick variant)."""
    final_eval: bool = False
    """Evaluate each run's final policy on the validation problems (k samples at top_p 1.0 and at
    val_top_p)."""

    @property
    def control(self) -> PanelArm:
        return self.arms[0]


PANEL_COMMON: dict[str, Any] = {
    # Validation on 256 held-out problems x 4 samples (top_p 0.7, as DAPO evaluates; the final evaluation adds
    # top_p 1.0 beside it); no dynamic sampling unless the panel tests it, so every generated group trains.
    "data.scratchpad.num_val": 256, "rollout.val_n": 4,
    "algorithm.dynamic_sampling": False, "trainer.gen_batch": TRAIN_BATCH_OF_BASE,
    "trainer.total_steps": 30, "checkpoint.save_every": 10,
}
"""Settings of every panel (before its own)."""

CLIP_SIXTEEN_UPDATES: dict[str, Any] = {
    # 16 optimizer steps per batch of 16 prompts (the released recipe's 512 / 32): the later mini-batches
    # train on a policy far enough from the old one that the clip is active.
    "trainer.mini_batch": 1, "algorithm.clip_low": 0.2, "algorithm.clip_high": 0.2,
    "logging.probe_every": 2, "trainer.total_steps": 30,
}
PROBE_ENTROPY = Measure("probe-set entropy, last steps", "probe/entropy", mean_over_last("probe/entropy"))
CLIP_SECONDARY = (Measure("up-clipped token fraction", "actor/clipfrac_upper",
                          mean_over_run("actor/clipfrac_upper")),
                  Measure("old probability of up-clipped tokens", "actor/upclip_old_prob",
                          mean_over_run("actor/upclip_old_prob")),
                  Measure("probe-set top-1 probability, last steps", "probe/top1_prob",
                          mean_over_last("probe/top1_prob")))
CLIP_ARMS = (PanelArm("clip-0.20", "clip_high 0.2"),
             PanelArm("clip-0.28", "clip_high 0.28", {"algorithm.clip_high": 0.28}))
FIG2 = "Fig. 2 (entropy of the actor with and without Clip-Higher: it collapses without)"
ENTROPY_KEPT = "higher with the wider upper clip (entropy kept)"

ONE_BATCH_RANDOM: dict[str, Any] = {
    # The reward-free control as one batch: under random rewards each arm's entropy drifts at random from step
    # to step, so whole runs add noise faster than the clip adds signal
    # (bench/results/2026-12-02-cpu-2core-clip- higher-pilot.md). One batch trained 16 times as a whole (one
    # mini-batch, 16 epochs) at a high learning rate: the ratios the clip reads are moved by the batch's own
    # updates (the case the clipping-bias argument makes), not by the drift other prompts' mini-batches cause
    # in a 118k-parameter model, and every arm of a seed trains the same tokens.
    "trainer.mini_batch": TRAIN_BATCH_OF_BASE,
    "trainer.ppo_epochs": 16,
    "optim.lr": 1e-3,
    "trainer.total_steps": 1,
    "algorithm.clip_low": 0.2,
    "algorithm.clip_high": 0.2,
    "logging.probe_every": 1,
    "algorithm.verifier": "random",
    "algorithm.random_reward_p": 0.5,
    "algorithm.overlong_buffer": False,
    "algorithm.overlong_filter": False,
    "trainer.val_every": 0,
    "trainer.val_before_train": False,
}
TAIL_TEMPERATURE = 1.5
"""A' samples and trains at this temperature (docs/ablation.md, "Why temperature 1.5"): the upper clip keeps
entropy down only by holding back tokens whose rise would raise their position's entropy, the rare tokens of
an LLM's long tail. The warmed-up scratchpad model at temperature 1.0 has almost no tail: the tokens it can
up-clip are the likely candidates at uncertain positions (a column digit among a few), and raising those
lowers entropy. At 1.5 the tail carries mass and is sampled. The panel at 1.0 beside it shows the
difference."""
BATCH_ENTROPY = Measure("entropy of the trained tokens (the one batch)", "actor/entropy",
                        mean_over_run("actor/entropy"))
CLIP_DOSE_ARMS = (PanelArm("clip-0.20", "clip_high 0.2"),
                  PanelArm("clip-0.28", "clip_high 0.28", {"algorithm.clip_high": 0.28}),
                  PanelArm("clip-0.35", "clip_high 0.35", {"algorithm.clip_high": 0.35}))
RANDOM_SECONDARY = (Measure("probe-set entropy after the batch", "probe/entropy",
                            mean_over_run("probe/entropy")), *CLIP_SECONDARY[:2],
                    Measure("share of up-clipped tokens in the tail (probability below exp(-H))",
                            "actor/upclip_tail_fraction", mean_over_run("actor/upclip_tail_fraction")),
                    Measure("low-clipped token fraction", "actor/clipfrac_lower",
                            mean_over_run("actor/clipfrac_lower")))

PANELS: tuple[Panel, ...] = (
    Panel("clip-higher-random",
          "Clip-Higher, random rewards (A'), one batch at temperature 1.5, a dose series", FIG2,
          {**ONE_BATCH_RANDOM, "rollout.temperature": TAIL_TEMPERATURE}, CLIP_DOSE_ARMS, BATCH_ENTROPY,
          ENTROPY_KEPT, RANDOM_SECONDARY, quick_arms=("clip-0.20", "clip-0.28", "clip-0.35")),
    Panel(
        "clip-higher-random-t1",
        "Clip-Higher, random rewards, one batch at temperature 1.0 (no tail to free)", FIG2,
        {**ONE_BATCH_RANDOM, "rollout.temperature": 1.0}, CLIP_ARMS, BATCH_ENTROPY,
        "no gain: the tokens the wider clip frees are the likely ones at their positions, whose rise lowers "
        "entropy (zero or lower)", RANDOM_SECONDARY, quick_arms=("clip-0.20", "clip-0.28")),
    Panel("clip-higher-task", "Clip-Higher, on the task", FIG2,
          {**CLIP_SIXTEEN_UPDATES, "trainer.val_every": 15}, CLIP_ARMS, PROBE_ENTROPY, ENTROPY_KEPT,
          (*CLIP_SECONDARY, Measure("validation mean@k, last", VAL_MEAN, mean_over_last(VAL_MEAN)))),
    Panel(
        "dynamic-sampling", "Dynamic sampling at one generation budget",
        "Fig. 6 (accuracy against training steps with and without dynamic sampling: the same accuracy "
        "sooner)",
        {"trainer.val_every": 5, "algorithm.max_gen_batches": 3},
        (PanelArm("off", "no dynamic sampling"),
         PanelArm("on", "dynamic sampling (refills up to 3 rounds)", {"algorithm.dynamic_sampling": True})),
        Measure("validation mean@k per sample generated (area / budget)", VAL_MEAN, val_auc_per_sample,
                x=SAMPLES_CUM), "higher with dynamic sampling (accuracy reached on fewer samples)",
        (Measure("all-equal share of generated groups", "train/all_equal_fraction",
                 mean_over_run("train/all_equal_fraction")),
         Measure("all-correct share of generated groups", "train/all_correct_fraction",
                 mean_over_run("train/all_correct_fraction"))), final_eval=True),
    Panel(
        "token-level-loss",
        "Token-level vs sample-level loss, room for long answers",
        "Fig. 4 (entropy and response length under sample-level loss: length grows unhealthily)",
        # Long-hand work is always right (no slips), compact work slips 30% per column: longer work is more
        # often right. 64 tokens hold every long-hand answer; no overlong shaping.
        {
            "rollout.max_response_length": 64, "data.scratchpad.slip_fraction": 0.3,
            "data.scratchpad.verbose_slip_fraction": 0.0, "algorithm.overlong_buffer": False,
            "algorithm.overlong_filter": False, "algorithm.loss_agg_mode": "seq-mean-token-mean",
            "trainer.val_every": 15
        },
        (PanelArm("sample-level", "seq-mean-token-mean"),
         PanelArm("token-level", "token-mean", {"algorithm.loss_agg_mode": "token-mean"})),
        Measure("slope of wrong responses' length (tokens/step)", "response_length/wrong_mean",
                slope_over_run("response_length/wrong_mean")),
        "lower with token-level loss (wrong answers do not grow long)",
        (Measure("entropy (trained tokens), last steps", "actor/entropy", mean_over_last("actor/entropy")),
         Measure("slope of right responses' length (tokens/step)", "response_length/correct_mean",
                 slope_over_run("response_length/correct_mean")),
         Measure("validation mean@k, last", VAL_MEAN, mean_over_last(VAL_MEAN)))),
    Panel(
        "overlong",
        "Overlong handling: none / filter / soft punishment",
        "Fig. 5 (accuracy and entropy with and without overlong filtering: steadier with it)",
        # 20 steps: truncation falls fastest early (the ladder: 22% vs 11% generated over the first 10
        # steps).
        {
            "algorithm.overlong_buffer": False, "algorithm.overlong_filter": False, "trainer.total_steps": 20,
            "trainer.val_every": 0, "trainer.val_before_train": False
        },
        (PanelArm("none", "no overlong handling"),
         PanelArm("filter", "overlong filtering", {"algorithm.overlong_filter": True}),
         PanelArm("soft", "soft overlong punishment", {"algorithm.overlong_buffer": True})),
        Measure("truncated fraction, last steps", "response_length/clip_ratio",
                mean_over_last("response_length/clip_ratio")),
        "filter: higher (no gradient against truncation); soft: lower",
        (Measure("degenerate run (truncation > 0.5 or train accuracy < 0.02 at the end)", "train/gen_acc",
                 degenerate), Measure("validation mean@k, last", VAL_MEAN, mean_over_last(VAL_MEAN))),
        quick_arms=("none", "filter", "soft")),
)
"""The mechanism panels, in the report's order."""

PANEL_NAMES = tuple(p.name for p in PANELS)


def panel_by_name(name: str) -> Panel:
    return PANELS[PANEL_NAMES.index(name)]


def varied_fields(panel: Panel) -> set[str]:
    """The fields the panel's treatments change."""
    return {k for arm in panel.arms for k in arm.change}


def panel_arm_fields(panel: Panel, arm: PanelArm, base: Config,
                     overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every dotted field an arm of `panel` sets: the common settings, the panel's, the user's `overrides`
    (the
    fields given on the command line, which win over the panel's regime), then the arm's one change."""
    fields = {**PANEL_COMMON, **panel.settings, **(overrides or {}), **arm.change}
    stand_ins = {GEN_BATCH_OF_BASE: base.trainer.gen_batch, TRAIN_BATCH_OF_BASE: base.trainer.train_batch}
    return {k: stand_ins.get(v, v) if isinstance(v, str) else v for k, v in fields.items()}


PROBE_AND_RANDOM_VERIFIER_FIELDS = frozenset(
    {"algorithm.verifier", "algorithm.random_reward_p", "logging.probe_every"})
"""The fields of the random verifier and the probe set the Clip-Higher panels need (a build without them
cannot configure those panels; the runner says so and runs the others)."""


def panel_arm_config(panel: Panel, arm: PanelArm, base: Config,
                     overrides: dict[str, Any] | None = None) -> Config:
    """The base config with the arm's fields set (checked like any config)."""
    return merge(base, nested(panel_arm_fields(panel, arm, base, overrides)))

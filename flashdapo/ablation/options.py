"""The options of `flashdapo ablate` (a section of their own, checked like the config tree's)."""

# No `from __future__ import annotations`: the checks below must be objects, not strings tyro evaluates
# in its own namespace.
from dataclasses import dataclass, field
from typing import Annotated

from ..config.checks import BATCH_MAX, BATCH_WHY, IS_PATH, Check, Section, at_most, ge, register_tree
from ..config.sampling import SAMPLES_MAX
from .arms import ARM_NAMES, PANEL_NAMES

DEFAULT_ABLATION_PRESET = "scratchpad"
PANEL_SEEDS, LADDER_SEEDS = 5, 3
"""Seeds when --seeds is 0 (its default): the panels (--quick too), --ladder."""


@dataclass
class AblateOptions(Section):
    """Run the mechanism panels (docs/ablation.md): each a control and treatments differing in one field,
    every arm for every seed on warmed-up base models, judged by a metric fixed in advance; then ablation.md
    (paired differences, t intervals, p-values, Holm) and a picture per panel in OUT. --ladder runs the
    paper's cumulative ladder instead. Any `flashdapo train` option (--preset, --config, --SECTION.FIELD
    VALUE) sets the base config (default: preset 'scratchpad')."""

    out: Annotated[str, IS_PATH, Check(bool, "a non-empty path")] = "runs/ablate"
    """Output directory: the base models, one run directory per (panel, arm, seed) or (arm, seed), the report.
    A rerun with the same OUT skips finished runs and resumes an interrupted one."""
    seeds: Annotated[int, ge(0), at_most(1000, "a training run per arm and seed")] = 0
    """Seeds per arm (trainer.seed = 0 .. seeds-1, shared by a panel's arms: paired); 0: 5 for the panels
    (--quick too), 3 for --ladder."""
    ladder: bool = False
    """Run the paper's six-rung cumulative ladder (DAPO Table 1) instead of the panels (`--ladder` alone:
    True)."""
    quick: bool = False
    """The short variant: the Clip-Higher panels with random rewards (at temperature 1.5: clip_high 0.2, 0.28
    and 0.35; at 1.0: 0.2 and 0.28) and the overlong panel (`--quick` alone: True). Its runs are the
    default's: the default after it runs only the rest."""
    panels: Annotated[list[str], Check(lambda names: bool(names) and all(n in PANEL_NAMES for n in names)
                                       and len(set(names)) == len(names),
                                       "distinct panel names among " + ", ".join(PANEL_NAMES))] = \
        field(default_factory=lambda: list(PANEL_NAMES))
    """Panels to run, by name (run in arms.py's order whatever the order given); refused with --quick or
    --ladder, which choose their own runs."""
    final_eval_k: Annotated[int, ge(0), at_most(SAMPLES_MAX, "samples per problem held together")] = 16
    """Samples per validation problem in the final evaluation of the panels that have one (at top_p 1.0 and at
    rollout.val_top_p); 0: none."""
    arms: Annotated[list[str], Check(lambda names: bool(names) and all(n in ARM_NAMES for n in names)
                                     and len(set(names)) == len(names),
                                     "distinct arm names among " + ", ".join(ARM_NAMES))] = \
        field(default_factory=lambda: list(ARM_NAMES))
    """--ladder: arms to run, by name, in the ladder's order whatever the order given (refused without
    --ladder: the panels are chosen with --panels)."""
    step_lines: bool = False
    """Print every training step's line (off: one line per run)."""
    base_probe_prompts: Annotated[int, ge(1), at_most(BATCH_MAX, BATCH_WHY)] = 64
    """--ladder: training prompts the base model is sampled on (rollout.n each) to measure its truncation and
    all-equal groups before the ladder."""


def panel_seeds(opts: AblateOptions) -> int:
    """The seeds the panels run: --seeds, or its default."""
    return opts.seeds or PANEL_SEEDS


def ladder_seeds(opts: AblateOptions) -> int:
    return opts.seeds or LADDER_SEEDS


register_tree(AblateOptions, "ablate.")

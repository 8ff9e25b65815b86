"""The options of `flashdapo ablate` (a section of their own, checked like the config tree's)."""

# No `from __future__ import annotations`: the checks below must be objects, not strings tyro evaluates
# in its own namespace.
from dataclasses import dataclass, field
from typing import Annotated

from ..config.checks import Check, Section, ge, register_tree
from .arms import ARM_NAMES

DEFAULT_ABLATION_PRESET = "scratchpad"


@dataclass
class AblateOptions(Section):
    """Run the paper's ablation ladder (docs/ablation.md): every arm for every seed on one warmed-up base model,
    then ablation.md and ablation.png in OUT. Any `flashdapo train` option (--preset, --config,
    --SECTION.FIELD VALUE) sets the base config the arms start from (default: preset 'scratchpad')."""

    out: Annotated[str, Check(bool, "a non-empty path")] = "runs/ablate"
    """Output directory: base/ (the warmed-up model), arms/ARM/seedS/ (one run directory each), arms.md,
    ablation.md, ablation.png. A rerun with the same OUT skips finished arms and resumes an interrupted one."""
    seeds: Annotated[int, ge(1)] = 3
    """Seeds per arm (trainer.seed = 0 .. seeds-1; the base model is the same for all)."""
    arms: Annotated[list[str], Check(lambda names: bool(names) and all(n in ARM_NAMES for n in names)
                                     and len(set(names)) == len(names),
                                     "distinct arm names among " + ", ".join(ARM_NAMES))] = \
        field(default_factory=lambda: list(ARM_NAMES))
    """Arms to run, by name, in the ladder's order whatever the order given."""
    step_lines: bool = False
    """Print every training step's line (off: one line per arm)."""
    base_probe_prompts: Annotated[int, ge(1)] = 64
    """Training prompts the base model is sampled on (rollout.n each) to measure its truncation and all-equal
    groups before the ladder."""


register_tree(AblateOptions, "ablate.")

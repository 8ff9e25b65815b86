"""What one ablation run left: the ladder's ArmRun and the panels' PanelRun, read by the runners that make
them and by the reports that draw them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config
from .arms import Arm, Panel, PanelArm
from .final_eval import FinalScore


@dataclass
class ArmRun:
    """One (arm, seed) run of the ladder and what it logged."""

    arm: Arm
    seed: int
    config: Config
    run_dir: Path
    history: list[dict]
    wall_s: float
    """Seconds the run took in the process that finished it (setup included)."""
    skipped: bool = False
    """Finished by an earlier `flashdapo ablate`."""


def samples_generated(run: ArmRun) -> int:
    """Responses sampled for training (every generation round, kept or dropped; validation not counted)."""
    rounds = sum(int(m.get("train/num_gen_batches", 0)) for m in run.history)
    return rounds * run.config.trainer.gen_batch * run.config.rollout.n


@dataclass
class PanelRun:
    """One (panel, arm, seed) run and what it logged."""

    panel: Panel
    arm: PanelArm
    seed: int
    config: Config
    history: list[dict]
    wall_s: float
    skipped: bool = False
    final: list[FinalScore] = field(default_factory=list)
    """The final evaluation (panels with final_eval), else []."""

    def value(self, measure) -> float | None:
        return measure.compute(self.history, self.config)


__all__ = ["ArmRun", "PanelRun", "samples_generated"]

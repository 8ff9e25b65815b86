"""The arms of the paper's ablation ladder (DAPO, Table 1), each adding one technique to the one before.

Order and definitions (docs/ablation.md, docs/algorithm.md):

| arm | adds | config |
|---|---|---|
| naive GRPO | (baseline) | clip 0.2 / 0.2, `seq-mean-token-mean`, no dynamic sampling, no overlong shaping |
| + overlong filtering | mask the loss of truncated responses | `overlong_filter` on |
| + Clip-Higher | decoupled clip, wider above | `clip_high` 0.28 |
| + soft overlong punishment | length penalty over the last L_cache tokens, replacing the filter | `overlong_buffer` on, `overlong_filter` off |
| + token-level loss | average the loss over tokens, not sequences | `loss_agg_mode` `token-mean` |
| + dynamic sampling (DAPO) | drop all-equal groups and refill | `dynamic_sampling` on, `gen_batch` the base's |

The paper's table writes each row as "+ X" on the row above; its final recipe (and the released one) uses
the soft punishment without the filter, so the soft-punishment arm swaps one for the other and the last
arm is the base config's full DAPO. Everything else (the dual clip c, learning rate, batch geometry) is
the base config's in every arm.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    Arm("naive-grpo", "naive GRPO", 30, {
        "algorithm.clip_low": 0.2, "algorithm.clip_high": 0.2, "algorithm.loss_agg_mode": "seq-mean-token-mean",
        "algorithm.dynamic_sampling": False, "trainer.gen_batch": TRAIN_BATCH_OF_BASE,
        "algorithm.overlong_buffer": False, "algorithm.overlong_filter": False}),
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

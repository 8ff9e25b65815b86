"""The ladder's arms match the paper's definitions, and each differs from the one before in exactly its technique."""

from __future__ import annotations

from flashdapo.ablation.arms import ARM_NAMES, ARMS, arm_config
from flashdapo.config import preset

BASE = preset("scratchpad")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_arms_follow_the_papers_order_and_numbers():
    assert ARM_NAMES == ("naive-grpo", "overlong-filter", "clip-higher", "soft-overlong", "token-level-loss",
                         "dynamic-sampling")
    assert [a.paper_aime for a in ARMS] == [30, 36, 38, 41, 42, 50]  # DAPO, Table 1


def test_arm_settings_match_the_papers_definitions():
    cfgs = [arm_config(i, BASE) for i in range(len(ARMS))]
    algos = [c.algorithm for c in cfgs]
    # clip 0.2 / 0.2 until Clip-Higher, then 0.2 / 0.28
    assert [(a.clip_low, a.clip_high) for a in algos] == [(0.2, 0.2)] * 2 + [(0.2, 0.28)] * 4
    # GRPO's sample-level loss until the token-level loss
    assert [a.loss_agg_mode for a in algos] == ["seq-mean-token-mean"] * 4 + ["token-mean"] * 2
    # overlong: nothing, then the filter, then the soft punishment in its place
    assert [(a.overlong_filter, a.overlong_buffer) for a in algos] == \
        [(False, False), (True, False), (True, False), (False, True), (False, True), (False, True)]
    # dynamic sampling only in the last arm; without it every generated group trains
    assert [a.dynamic_sampling for a in algos] == [False] * 5 + [True]
    assert [c.trainer.gen_batch for c in cfgs] == [BASE.trainer.train_batch] * 5 + [BASE.trainer.gen_batch]
    assert BASE.trainer.gen_batch > BASE.trainer.train_batch
    # the last arm is the preset itself: full DAPO
    assert cfgs[-1] == BASE


def test_each_arm_differs_from_the_one_before_in_exactly_its_technique():
    flats = [_flat(arm_config(i, BASE).to_dict()) for i in range(len(ARMS))]
    for arm, before, after in zip(ARMS[1:], flats[:-1], flats[1:], strict=True):
        changed = {k for k in after if after[k] != before[k]}
        assert changed == set(arm.adds), (arm.name, changed)

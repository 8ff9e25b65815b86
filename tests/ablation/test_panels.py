"""The mechanism panels are well-formed (each treatment changes exactly one field of its control, on the built
configs) and their pre-registered metrics compute what they say on hand-made histories."""

from __future__ import annotations

import pytest

from flashdapo.ablation.arms import (
    PANEL_COMMON,
    PANELS,
    PROBE_AND_RANDOM_VERIFIER_FIELDS,
    degenerate,
    mean_over_last,
    mean_over_run,
    nested,
    panel_arm_config,
    panel_arm_fields,
    sample_budget,
    slope_over_run,
    val_auc_per_sample,
)
from flashdapo.config import ConfigError, merge, preset

BASE = preset("scratchpad")
LOGGING_BRANCH_FIELDS = PROBE_AND_RANDOM_VERIFIER_FIELDS


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _configs(panel, strip: set[str] = frozenset()):
    """Each arm's built config; `strip`: fields left out of the panel's settings (compared only)."""
    out = []
    for arm in panel.arms:
        fields = {k: v for k, v in panel_arm_fields(panel, arm, BASE).items() if k not in strip}
        out.append(merge(BASE, nested(fields)))
    return out


def test_panels_are_named_pairs_or_dose_series_with_a_control_first():
    assert [p.name for p in PANELS] == ["clip-higher-random", "clip-higher-random-t1", "clip-higher-task",
                                        "dynamic-sampling", "token-level-loss", "overlong"]
    for panel in PANELS:
        assert panel.control.change == {} and len(panel.arms) >= 2, panel.name
        assert len({a.name for a in panel.arms}) == len(panel.arms)
        assert all(len(arm.change) == 1 for arm in panel.arms[1:]), panel.name
        assert panel.figure.startswith("Fig. ") and panel.metric.name and panel.expected
        assert set(panel.quick_arms) <= {a.name for a in panel.arms}
    assert [p.name for p in PANELS if p.quick_arms] == ["clip-higher-random", "clip-higher-random-t1", "overlong"]


def test_each_treatment_differs_from_its_control_in_exactly_one_field():
    unbuildable = []
    for panel in PANELS:
        try:
            cfgs = [panel_arm_config(panel, arm, BASE) for arm in panel.arms]
        except ConfigError:
            # Only the random verifier's and the probe's fields may be missing from this build: without them,
            # the panel builds, and the same one-field check holds on it.
            unbuildable.append(panel.name)
            cfgs = _configs(panel, strip=LOGGING_BRANCH_FIELDS)
        control = _flat(cfgs[0].to_dict())
        for arm, cfg in zip(panel.arms[1:], cfgs[1:], strict=True):
            flat = _flat(cfg.to_dict())
            changed = {k for k in flat if flat[k] != control[k]}
            assert changed == set(arm.change), (panel.name, arm.name, changed)
    assert set(unbuildable) <= {"clip-higher-random", "clip-higher-random-t1", "clip-higher-task"}


def test_panel_regimes():
    by = {p.name: p for p in PANELS}
    random_clip = panel_arm_fields(by["clip-higher-random"], by["clip-higher-random"].control, BASE)
    assert random_clip["algorithm.verifier"] == "random" and random_clip["algorithm.random_reward_p"] == 0.5
    for name in ("clip-higher-random", "clip-higher-random-t1", "clip-higher-task"):
        cfg = panel_arm_config(by[name], by[name].control, BASE)
        assert cfg.trainer.train_batch // cfg.trainer.mini_batch * cfg.trainer.ppo_epochs == 16  # 16 updates a batch
        assert [a.change.get("algorithm.clip_high", cfg.algorithm.clip_high) for a in by[name].arms][:2] == [0.2, 0.28]
    assert [a.change for a in by["clip-higher-random"].arms][2:] == [{"algorithm.clip_high": 0.35}]
    # A': one batch, trained as a whole (one mini-batch, 16 epochs), judged on that batch's trained tokens
    assert random_clip["trainer.total_steps"] == 1 and random_clip["trainer.ppo_epochs"] == 16
    assert random_clip["trainer.mini_batch"] == BASE.trainer.train_batch
    for name in ("clip-higher-random", "clip-higher-random-t1"):
        assert by[name].metric.key == "actor/entropy"
    # ... at temperature 1.5 (a sampled tail), beside the same panel at 1.0: the two differ in that field only
    tail, t1 = (_flat(panel_arm_config(by[n], by[n].control, BASE).to_dict())
                for n in ("clip-higher-random", "clip-higher-random-t1"))
    assert {k for k in tail if tail[k] != t1[k]} == {"rollout.temperature"}
    assert (tail["rollout.temperature"], t1["rollout.temperature"]) == (1.5, 1.0)
    # dynamic sampling: both arms generate train_batch prompts a round, so the treatment refills
    ds = [panel_arm_config(by["dynamic-sampling"], a, BASE) for a in by["dynamic-sampling"].arms]
    assert [c.trainer.gen_batch for c in ds] == [BASE.trainer.train_batch] * 2
    assert [c.algorithm.dynamic_sampling for c in ds] == [False, True] and ds[1].algorithm.max_gen_batches > 1
    token = panel_arm_config(by["token-level-loss"], by["token-level-loss"].control, BASE)
    assert not token.algorithm.overlong_buffer and not token.algorithm.overlong_filter
    assert token.rollout.max_response_length > BASE.rollout.max_response_length
    assert token.data.scratchpad.verbose_slip_fraction < token.data.scratchpad.slip_fraction
    for panel in PANELS:
        cfg = panel_arm_fields(panel, panel.control, BASE)
        assert cfg.get("data.scratchpad.num_val", PANEL_COMMON["data.scratchpad.num_val"]) >= 256


def _history(key: str, values: list[float]) -> list[dict]:
    return [{"step": 0, "val/acc/mean@k": 0.1}] + [{"step": i + 1, key: v} for i, v in enumerate(values)]


def test_measures_on_hand_made_histories():
    cfg = merge(BASE, {"trainer": {"total_steps": 8}})  # last steps: the last 2
    history = _history("x", [1, 2, 3, 4, 5, 6, 7, 9])
    assert mean_over_last("x")(history, cfg) == pytest.approx(8.0)
    assert mean_over_run("x")(history, cfg) == pytest.approx(37 / 8)
    assert slope_over_run("x")(_history("x", [3, 5, 7, 9]), cfg) == pytest.approx(2.0)
    assert mean_over_last("missing")(history, cfg) is None and slope_over_run("x")(_history("x", [1]), cfg) is None


def test_val_auc_per_sample_cuts_at_the_budget():
    cfg = merge(BASE, {"trainer": {"total_steps": 4, "train_batch": 2, "gen_batch": 2, "mini_batch": 1},
                       "rollout": {"n": 2}})
    assert sample_budget(cfg) == 16
    # accuracy 0 at 0 samples, 0.4 at 8, 0.8 at 24: cut at 16 where the line reads 0.6
    hist = [{"step": 0, "val/acc/mean@k": 0.0}, {"step": 2, "val/acc/mean@k": 0.4, "train/generated_samples_cum": 8},
            {"step": 4, "val/acc/mean@k": 0.8, "train/generated_samples_cum": 24}]
    assert val_auc_per_sample(hist, cfg) == pytest.approx((8 * 0.2 + 8 * 0.5) / 16)
    # a curve ending before the budget holds its last value
    short = hist[:2]
    assert val_auc_per_sample(short, cfg) == pytest.approx((8 * 0.2 + 8 * 0.4) / 16)
    assert val_auc_per_sample([{"step": 3, "val/acc/mean@k": 0.5}], cfg) is None  # no samples counter


def test_degenerate_is_the_definition_fixed_in_advance():
    cfg = merge(BASE, {"trainer": {"total_steps": 4}})
    def run(truncated, acc):
        return [{"step": i + 1, "train/gen_truncated": t, "train/gen_acc": a} for i, (t, a) in
                enumerate(zip(truncated, acc, strict=True))]
    assert degenerate(run([0.9, 0.1, 0.1, 0.2], [0.3] * 4), cfg) == 0.0
    assert degenerate(run([0.1, 0.1, 0.1, 0.6], [0.3] * 4), cfg) == 1.0
    assert degenerate(run([0.1] * 4, [0.3, 0.3, 0.3, 0.01]), cfg) == 1.0
    assert degenerate(run([0.1] * 4, [0.3, 0.3, 0.3, 0.03]), cfg) == 0.0

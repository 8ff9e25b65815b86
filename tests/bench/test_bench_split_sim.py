"""bench/split_sim.py and bench/split_schedule.py: the simulated split-placement schedule keeps its own rules
(no overlap at k = 0, the exact lag, at most k + 1 staged versions) and matches a hand-computed step."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `bench` is a top-level folder, not installed

from bench import longtail_model as lm  # noqa: E402
from bench import split_sim  # noqa: E402
from bench.split_schedule import Collection, PhaseCosts, generate_batches, run_schedule  # noqa: E402

TINY = lm.Model("tiny", params=1e9, layers=8, hidden=1024, kv_heads=2)
"""Small enough that one engine holds every response (no preemption) and decode is memory-bound."""


def tiny_split(gen_batch=12, train_batch=4, n=4, rollout=1, gpus=2) -> split_sim.Placement:
    return split_sim.Placement(TINY, tp=1, gpus=gpus, rollout=rollout, train_batch=train_batch,
                               gen_batch=gen_batch, n=n)


def tiny_run(collection: Collection, k: int, placement=None, batches=8):
    p = placement or tiny_split()
    generated = generate_batches(split_sim.engine_setup(p), collection, batches, seed=3)
    costs = split_sim.phase_costs(p, generated, mfu=0.35)
    return run_schedule(costs, k, colocated=not p.rollout), generated, costs


def _intersects(xs, ys) -> bool:
    return any(min(b, d) > max(a, c) for a, b in xs for c, d in ys)


@pytest.mark.parametrize("carry", [False, True])
def test_k0_split_never_overlaps_the_trainer_waits_while_the_engines_generate(carry):
    trace, batches, costs = tiny_run(Collection(600, 1.2, carry), k=0)
    assert not _intersects(trace.rollout, trace.trainer)
    f = split_sim.summarize(trace, batches, costs)
    assert f.overlap == 0 and f.trainer_idle > 0 and f.rollout_idle > 0


def test_k1_split_does_overlap():
    trace, batches, costs = tiny_run(Collection(600, 1.2, False), k=1)
    assert _intersects(trace.rollout, trace.trainer)
    assert split_sim.summarize(trace, batches, costs).overlap > 0


@pytest.mark.parametrize("k", [0, 1, 2])
def test_without_carry_every_trained_token_lags_exactly_k_after_the_first_k_steps(k):
    trace, batches, _ = tiny_run(Collection(600, 1.2, False), k=k)
    for s in range(1, len(batches) + 1):
        lags = split_sim.token_lags(trace, batches, s)
        assert list(lags) == [min(k, s - 1)], f"step {s}: {lags}"
        assert trace.version[s] == max(0, s - 1 - k)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_rollout_never_starts_a_batch_before_its_weights_exist(k):
    """Batch b starts only after trainer step b - 1 - k (and its push) ended; at most k + 1 versions wait."""
    rng = np.random.default_rng(k)
    n = 12
    costs = PhaseCosts(gen_s=list(rng.uniform(1, 10, n)), train_s=list(rng.uniform(1, 10, n)), load_s=0.1,
                       push_s=0.3, transfer_s=[0.2] * n)
    trace = run_schedule(costs, k, colocated=False)
    for b, (start, _) in enumerate(trace.rollout, 1):
        if b - 1 - k >= 1:
            assert start >= trace.step_end[b - 1 - k]
    assert trace.max_staged <= k + 1 and trace.max_queued <= k + 1


def test_with_carry_some_tokens_are_older_than_k_and_none_is_fresher():
    trace, batches, _ = tiny_run(Collection(600, 1.2, True), k=1)
    lags = {}
    for s in range(3, len(batches) + 1):
        for lag, tokens in split_sim.token_lags(trace, batches, s).items():
            lags[lag] = lags.get(lag, 0) + tokens
    assert min(lags) == 1 and max(lags) > 1


def test_one_step_off_is_faster_than_k0_on_a_tail_dominated_distribution():
    """sigma 2: a few responses reach the 20480 cap while the mean is 500, so generation is the tail."""
    collection = Collection(500, 2.0, False)
    s_per_step = {}
    for k in (0, 1):
        trace, batches, costs = tiny_run(collection, k)
        s_per_step[k] = split_sim.summarize(trace, batches, costs).s_per_step
    assert s_per_step[1] < 0.8 * s_per_step[0]


def test_the_same_seed_repeats_and_another_differs():
    p, col = tiny_split(), Collection(600, 1.2, True)
    a, b = (split_sim.simulate(p, col, (0, 1), seed=5, batches=6) for _ in range(2))
    c = split_sim.simulate(p, col, (0, 1), seed=6, batches=6)
    assert a == b and a != c


def _hand_gen_s(responses: int, length: int) -> float:
    """One engine, every response admitted at once (prompt prefill), then `length` memory-bound decode steps
    of `responses` rows (the weights and the growing KV cache read once per step)."""
    prompt, params, kv = lm.PROMPT, TINY.params, TINY.kv_bytes
    prefill = responses * (2 * params * prompt + 2 * TINY.layers * TINY.hidden * prompt ** 2) / lm.FLOPS
    kv_tokens = length * responses * prompt + responses * length * (length - 1) / 2
    return prefill + (length * 2 * params + kv * kv_tokens) / lm.HBM_BYTES_S


def _hand_train_s(responses: int, length: int) -> float:
    seq = length + lm.PROMPT
    flops = responses * (8 * TINY.params * seq + 8 * TINY.layers * TINY.hidden * seq ** 2)
    return flops / (lm.FLOPS * 0.35)


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("length", [1000, 8000])
def test_constant_lengths_match_a_hand_computed_step(k, length):
    """Every response `length` tokens, every group informative, one round: each phase's seconds by hand,
    and the steady-state period of a strict lag-k pipeline: max(rollout, trainer, cycle / (k + 1))."""
    responses, weights = 4 * 2, 2 * TINY.params
    collection = Collection(length, 0.0, False, kept=1.0)
    gen = _hand_gen_s(responses, length) + weights / lm.HBM_BYTES_S  # + loading the staged weights
    train = _hand_train_s(responses, length) + weights / split_sim.GATHER_BYTES_S + weights / split_sim.NIC_BYTES_S
    transfer = responses * length * split_sim.BATCH_BYTES_PER_TOKEN / split_sim.NIC_BYTES_S
    placement = tiny_split(gen_batch=4, train_batch=4, n=2)
    trace, batches, costs = tiny_run(collection, k, placement)
    assert costs.gen_s[0] + costs.load_s == pytest.approx(gen, rel=1e-9)
    assert costs.train_s[0] + costs.push_s == pytest.approx(train, rel=1e-9)
    expected = max(gen, train, (gen + transfer + train) / (k + 1))
    assert split_sim.summarize(trace, batches, costs).s_per_step == pytest.approx(expected, rel=1e-9)


def test_colocated_constant_lengths_add_every_phase_and_the_sleep_and_wake():
    responses, length, weights = 8, 1000, 2 * TINY.params
    switch = weights / split_sim.PCIE_BYTES_S + split_sim.SWITCH_FIXED_S
    expected = (switch + _hand_gen_s(responses, length) + switch + _hand_train_s(responses, length)
                + weights / split_sim.GATHER_BYTES_S)
    placement = split_sim.Placement(TINY, tp=1, gpus=1, train_batch=4, gen_batch=4, n=2)
    trace, batches, costs = tiny_run(Collection(length, 0.0, False, kept=1.0), 0, placement)
    f = split_sim.summarize(trace, batches, costs)
    assert f.s_per_step == pytest.approx(expected, rel=1e-9)
    assert f.overlap == 0 and f.lag_max == 0


def test_colocated_refuses_a_lag():
    costs = PhaseCosts(gen_s=[1.0], train_s=[1.0], load_s=0, push_s=0, transfer_s=[0.0])
    with pytest.raises(ValueError, match="max_lag"):
        run_schedule(costs, 1, colocated=True)

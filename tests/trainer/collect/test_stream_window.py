"""Streaming's memory does not grow with rollout.agree_every: an agreement all-reduces a fixed handful of
figures, and the window between agreements keeps one entry per group kept, not one per engine step; the
first engine step that met the target, found from those entries, is the one a per-step record gives."""

from __future__ import annotations

import random

import pytest

from flashdapo.config import ConfigError, merge
from flashdapo.profiling import StageTimer
from flashdapo.reward import Verdict
from flashdapo.trainer.collect import streaming
from flashdapo.trainer.collect.streaming import StreamState, stream_groups
from tests.helpers.collecting import ENV, N, long_tail, stream_config, stream_sampler
from tests.trainer.scripted import PlainTokenizer, ScriptedStream


def _informative(text: str, truth: str) -> Verdict:
    member = int(text.split()[1])
    return Verdict(1.0 if member == 0 else -1.0, member == 0, text)


def _stream(cfg):
    engine = ScriptedStream(long_tail, N)
    engine.version = 1
    return stream_groups(1, StreamState(), stream_sampler(cfg), engine, PlainTokenizer(), _informative, cfg, ENV,
                         StageTimer(ENV.device), version=1)


def test_an_agreement_all_reduces_the_same_figures_whatever_agree_every(monkeypatch):
    sizes: dict[int, list[int]] = {}
    real = streaming.all_reduce
    for every in (1, 7, 1000):
        seen = sizes.setdefault(every, [])
        monkeypatch.setattr(streaming, "all_reduce", lambda t, *a, seen=seen, **k: (seen.append(t.numel()),
                                                                                     real(t, *a, **k))[1])
        cfg = merge(stream_config(carry=True), {"algorithm": {"max_gen_batches": 1},
                                                "rollout": {"agree_every": every}})
        collected, stats = _stream(cfg)
        # The 4th group to complete meets the target (as in test_streaming's wait test); the stop waits for the
        # next multiple of `every` engine steps, idle ones included once every request has finished.
        met = sorted(max(long_tail(p, m) for m in range(N)) for p in range(8))[3]
        assert len(collected.groups) == 4
        assert stats.ticks == met + (-met % every) and stats.ticks_after_target == -met % every
    assert max(sizes[1000]) == max(sizes[1]) == max(sizes[7]) <= 8, sizes


def test_the_window_keeps_an_entry_per_group_kept_not_per_engine_step(monkeypatch):
    monkeypatch.setattr(streaming, "_clock", lambda: 0.0)
    window = streaming._Window(0.0, 3)
    for step in range(100_000):
        window.stepped(3 + (step in (10, 5000)) + (step >= 5000))
    assert window.steps == 100_000 and [(s, k) for s, k, _ in window.rises] == [(11, 4), (5001, 5)]


def _brute_force(target: int, ranks: list[list[int]]) -> int:
    """The first index whose kept groups, summed over ranks, reach target: each rank's count at the window's
    start and after each engine step (what the agreement used to all-reduce)."""
    return next(i for i, total in enumerate(map(sum, zip(*ranks, strict=True))) if total >= target)


@pytest.mark.parametrize("seed", range(40))
def test_the_first_step_reaching_the_target_is_the_per_step_records(seed):
    rng = random.Random(seed)
    world, steps = rng.randint(1, 5), rng.randint(0, 30)
    per_rank = []
    for _ in range(world):
        kept = [rng.randint(0, 3)]
        for _ in range(steps):
            kept.append(kept[-1] + (rng.random() < 0.25) * rng.randint(1, 3))
        per_rank.append(kept)
    target = rng.randint(1, sum(k[-1] for k in per_rank) or 1)
    if sum(k[-1] for k in per_rank) < target:
        return
    gathered = [(kept[0], [(s, k) for s, k in enumerate(kept) if s and k > kept[s - 1]]) for kept in per_rank]
    assert streaming.first_step_reaching(target, gathered) == _brute_force(target, per_rank)


def test_agree_every_is_bounded():
    with pytest.raises(ConfigError, match=r"rollout.agree_every: expected at most 1,024 \(the stop waits"):
        merge(stream_config(carry=True), {"rollout": {"agree_every": 1_000_000_000}})

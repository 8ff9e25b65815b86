"""Streaming dynamic sampling (trainer/streaming.py) over a scripted streaming engine: carried responses keep
the version and log-prob of every token, nothing is lost or trained twice, the state survives a checkpoint
round trip, and the length bias of stopping early without carrying over; then the training command: streaming
without an early stop is the rounds run bitwise, a fixed-seed streaming run repeats bitwise, it resumes
bitwise from a checkpoint holding carried responses, and a resume with streaming turned off says in one line
what of the checkpoint's streams it drops."""

import json
import subprocess
import sys

import pytest
import torch

from flashdapo.config import merge
from flashdapo.profiling import StageTimer
from flashdapo.reward import Verdict
from flashdapo.trainer.collect.streaming import StreamState, dropped_streams_line, stream_groups
from flashdapo.trainer.loop import train
from tests.helpers.collecting import ENV, N, long_tail, stream_config, stream_sampler
from tests.helpers.runs import (
    ROOT,
    TINY,
    TRAINER_SCRIPTS,
    quick_config,
    resume_config,
    run_metrics,
    subprocess_env,
    torchrun,
)
from tests.trainer.scripted import PlainTokenizer, ScriptedStream


def every_prompt_informative(text: str, truth: str) -> Verdict:
    prompt, member = map(int, text.split()[:2])
    ok = member == 0  # one correct response per group: every group is informative
    return Verdict(1.0 if ok else -1.0, ok, text)


def _steps(cfg, steps: int, engine: ScriptedStream, state: StreamState | None = None, start: int = 1):
    state = state or StreamState()
    sampler = stream_sampler(cfg)
    out = []
    for step in range(start, start + steps):
        engine.version = step
        collected, stats = stream_groups(step, state, sampler, engine, PlainTokenizer(), every_prompt_informative,
                                         cfg, ENV, StageTimer(ENV.device), version=step)
        out.append((collected, stats))
    return out, state, sampler


def test_carried_responses_keep_each_tokens_version_and_log_prob():
    cfg = stream_config(carry=True)
    steps, _, _ = _steps(cfg, 6, ScriptedStream(long_tail, N))
    mixed = 0
    for step, (collected, stats) in enumerate(steps, start=1):
        assert len(collected.groups) == 4 and stats.finished_groups >= 1  # some kept past the last step's target
        for group in collected.groups:
            for tokens, versions, logps in zip(group.responses, group.versions, group.sampler_logprobs):
                assert len(tokens) == len(versions) == len(logps) == long_tail(int(tokens[0]), int(tokens[1]))
                # The behaviour log-prob of each token is the one of the weights that sampled it.
                torch.testing.assert_close(logps, -(versions.double() + 1).float())
                assert 1 <= int(versions.min()) and int(versions.max()) <= step  # rolled-over groups: older
                mixed += int(versions.min()) < step
    assert mixed > 0, "some trained responses were sampled across a weight update"


@pytest.mark.parametrize("carry", [True, False])
def test_no_response_is_lost_or_trained_twice(carry):
    cfg = stream_config(carry)
    steps, state, _ = _steps(cfg, 8, ScriptedStream(long_tail, N))
    trained = [int(g.prompt[0]) for collected, _ in steps for g in collected.groups]
    assert len(trained) == 8 * 4 and len(set(trained)) == len(trained)
    waiting = {int(g.prompt.ids[0]) for g in state.pending.values()} | {int(g.prompt[0]) for g in state.ready}
    waiting |= {int(p.ids[0]) for _, p in state.queue}
    assert not waiting & set(trained)
    dropped = sum(stats.dropped for _, stats in steps)
    pulled = state.pulls * cfg.trainer.gen_batch
    # Every prompt pulled is trained, still waiting, or (without carry) dropped with its partial responses.
    assert len(trained) + len(waiting) + dropped == pulled
    assert (dropped > 0) != carry


def test_early_stop_without_carry_biases_toward_short_responses_and_carry_does_not():
    def mean_trained_length(carry: bool) -> float:
        # 16 prompts in flight, 4 trained per step: the early stop takes the fastest quarter.
        steps, _, _ = _steps(stream_config(carry, gen_batch=16), 30, ScriptedStream(long_tail, N))
        lengths = [len(r) for collected, _ in steps for g in collected.groups for r in g.responses]
        return sum(lengths) / len(lengths)

    population = sum(long_tail(p, m) for p in range(480) for m in range(N)) / (480 * N)
    without, with_carry = mean_trained_length(False), mean_trained_length(True)
    # Measured: 10.05 without carry, 12.65 with, 13.21 over the prompts (0.76x and 0.96x).
    assert without < 0.8 * population  # the long responses were aborted and never trained
    assert abs(with_carry - population) < 0.06 * population


class CountingStream(ScriptedStream):
    """A ScriptedStream that counts its engine steps: the clock of the wait-after-target test."""

    steps = 0

    def step(self):
        self.steps += 1
        return super().step()


@pytest.mark.parametrize("every", [1, 7])
def test_the_wait_after_the_target_is_the_steps_run_until_the_ranks_agree(monkeypatch, every):
    from flashdapo.trainer.collect import streaming

    # One pull of 8 prompts, all informative: the 4th group to complete meets the target of 4, at the step
    # where its longest response finishes (one token per step, every request from the first step on).
    cfg = merge(stream_config(carry=True), {"algorithm": {"max_gen_batches": 1}, "rollout": {"agree_every": every}})
    met = sorted(max(long_tail(p, m) for m in range(N)) for p in range(8))[3]
    engine = CountingStream(long_tail, N)
    monkeypatch.setattr(streaming, "_clock", lambda: float(engine.steps))  # one unit per engine step
    (collected, stats), = _steps(cfg, 1, engine)[0]
    after = -met % every  # the stop waits for the next multiple of `every` steps
    assert (every == 1) == (after == 0), "the lengths give the 7-step run a wait"
    assert stats.ticks == met + after and stats.ticks_after_target == after
    assert stats.wait_after_target_s == float(after)  # the abort takes no step
    assert len(collected.groups) == 4


def test_stream_state_round_trips_through_a_checkpoint_file(tmp_path):
    cfg = stream_config(carry=True)
    _, state, sampler = _steps(cfg, 2, ScriptedStream(long_tail, N))
    assert state.pending and any(len(r.tokens) for g in state.pending.values() for r in g.responses)
    torch.save(state.to_plain(), tmp_path / "s.pt")
    restored = StreamState.from_plain(torch.load(tmp_path / "s.pt", weights_only=True))
    a, _, _ = _steps(cfg, 3, ScriptedStream(long_tail, N), state, start=3)
    sampler2 = stream_sampler(cfg)
    sampler2.load_state_dict(sampler.state_dict())
    b, _, _ = _steps(cfg, 3, ScriptedStream(long_tail, N), restored, start=3)
    for (ca, _), (cb, _) in zip(a, b):
        assert [[r.tolist() for r in g.responses] for g in ca.groups] == [[r.tolist() for r in g.responses]
                                                                           for g in cb.groups]


def test_the_line_of_dropped_streams_counts_every_ranks_pending_and_ready_groups():
    """What a resume with streaming off drops, summed over the ranks' saved streams (None: a rank that saved
    none); nothing to drop, no line."""
    cfg = stream_config(carry=True)
    _, state, _ = _steps(cfg, 2, ScriptedStream(long_tail, N))
    plain = state.to_plain()
    pending, ready, queued = len(state.pending), len(state.ready), len(state.queue)
    assert pending
    line = dropped_streams_line([plain, None, plain])
    assert "\n" not in line and line.startswith("rollout.streaming is off (checkpoint.allow_changes): the checkpoint's "
                                                "streams are dropped, not trained: ")
    assert f"{2 * pending} pending groups (their responses sampled so far), {2 * ready} ready group" in line, line
    assert ("queued prompt" in line) == bool(queued) and "a rounds collector keeps no work between steps" in line
    four = {"pending": {k: plain["pending"][k] for k in list(plain["pending"])[:1]}, "ready": ["a ready group"], "queue": []}
    assert "4 pending groups (their responses sampled so far), 4 ready groups (a rounds" in dropped_streams_line(
        [four] * 4)
    assert dropped_streams_line([StreamState().to_plain(), None]) is None and dropped_streams_line([]) is None


# ---------------------------------------------------------------------------------------------------
# The training command

STREAM = ["--rollout.streaming", "True", "--model.toy.sft-steps", "60", "--rollout.max-response-length", "24"]


def _rows(run_dir, drop=("timing_s/", "perf/", "stream/")):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


@pytest.mark.distributed
def test_streaming_without_an_early_stop_trains_as_rounds_do(tmp_path):
    """Dynamic sampling off: every group of the batch trains, so the stream stops only when all finished."""
    base = [*TINY, "--model.toy.sft-steps", "60", "--rollout.max-response-length", "24", "--trainer.total-steps", "3"]
    torchrun(1, "-m", "flashdapo", "train", *base, "--logging.run-dir", str(tmp_path / "rounds"))
    # Without partial rollouts: nothing is carried, so the rollout correction stays off as in rounds.
    torchrun(1, "-m", "flashdapo", "train", *base, "--rollout.streaming", "True", "--rollout.partial-rollouts",
             "False", "--logging.run-dir", str(tmp_path / "stream"))
    rounds, stream = _rows(tmp_path / "rounds"), _rows(tmp_path / "stream")
    assert len(rounds) == 3 and rounds == stream


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_streaming_repeats_and_resumes_bitwise_with_carried_responses(tmp_path, ranks):
    common = [*TINY, *STREAM, "--algorithm.dynamic-sampling", "True", "--algorithm.max-gen-batches", "0",
              "--trainer.gen-batch", "8", "--checkpoint.save-every", "2"]
    # The interrupted run's steps 1-2 come from a process of their own: equal to the straight run's, they are
    # the fixed-seed repeat; its steps 3-4, after the resume, are the resume's check.
    straight, resumed = tmp_path / "a", tmp_path / "r"
    torchrun(ranks, "-m", "flashdapo", "train", *common, "--trainer.total-steps", "4", "--logging.run-dir",
             str(straight))
    if ranks == 1:  # SIGKILL inside step 3 (after its generation), after the checkpoint of step 2
        proc = subprocess.run([sys.executable, str(TRAINER_SCRIPTS / "kill_during_step.py"), "3", *common,
                               "--trainer.total-steps", "4", "--logging.run-dir", str(resumed)],
                              capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=300)
        assert proc.returncode == -9, proc.stderr[-3000:]
    else:
        torchrun(ranks, "-m", "flashdapo", "train", *common, "--trainer.total-steps", "2", "--logging.run-dir",
                 str(resumed))
    assert len(list((resumed / "checkpoints" / "step_00000002").glob("stream_rank*.pt"))) == ranks
    torchrun(ranks, "-m", "flashdapo", "train", *common, "--trainer.total-steps", "4", "--logging.run-dir", str(resumed),
             "--checkpoint.resume", "auto")
    keep = ("timing_s/", "perf/")
    a, r = (_rows(d, keep) for d in (straight, resumed))
    assert len(a) == len(r) == 4
    assert any(row.get("stream/carried", 0) > 0 for row in a[:2]), "the checkpoint held carried responses"
    # The 2-step run validated at its last step; the straight one did not.
    strip = lambda rows: [{k: v for k, v in row.items() if not k.startswith("val/")} for row in rows]
    assert strip(r) == strip(a)


def test_a_resume_with_streaming_turned_off_says_how_many_groups_it_drops(tmp_path, capsys):
    """A streaming checkpoint holding pending and ready groups, resumed with --rollout.streaming false
    --checkpoint.allow-changes rollout.streaming: its streams have no collector to go to; one line says how many
    groups are dropped and why (in-process, the tiny toy run: seconds)."""
    stream = {"rollout": {"streaming": True, "max_response_length": 16, "agree_every": 4},
              "algorithm": {"dynamic_sampling": True, "max_gen_batches": 0, "verifier": "random"},
              "model": {"toy": {"sft_steps": 60}}, "trainer": {"gen_batch": 8, "total_steps": 1}}
    run_dir = tmp_path / "run"
    train(quick_config(run_dir, **stream))
    saved = torch.load(run_dir / "checkpoints" / "step_00000001" / "stream_rank0.pt", weights_only=True)
    pending, ready = len(saved["pending"]), len(saved["ready"])
    assert pending and ready, (pending, ready)  # the checkpoint holds both (7 and 4 here)
    queued = f", {len(saved['queue'])} queued prompts" if saved["queue"] else ""
    capsys.readouterr()
    run = train(merge(resume_config(run_dir, **stream), {"rollout": {"streaming": False}, "trainer": {"total_steps": 2},
                                                         "checkpoint": {"allow_changes": ["rollout.streaming"]}}))
    lines = [line for line in capsys.readouterr().out.splitlines() if "streams are dropped" in line]
    assert lines == [f"flashdapo: rollout.streaming is off (checkpoint.allow_changes): the checkpoint's streams are "
                     f"dropped, not trained: {pending} pending groups (their responses sampled so far), {ready} ready "
                     f"groups{queued} (a rounds collector keeps no work between steps; their prompts are not drawn "
                     "again this epoch)"]
    assert run.start_step == 1 and [r["step"] for r in run_metrics(run_dir)] == [1, 2]

"""Streaming dynamic sampling (rollout.streaming): steps 1-4 of a training step
(docs/architecture.md, "One training step") without waiting for the tail.

The choices, before the code:

- **One response per request.** Each prompt of the step becomes n requests of the engine's stream
  (`rollout/base.py` StreamingEngine); a group is scored and filtered (`algorithm.filter_metric`) the
  moment its last response finishes.
- **Top-up.** Each rank keeps at most max_in_flight / world prompts in flight; prompts come from the
  shared sampler a global batch at a time (every rank pulls together, so the samplers stay at one
  position), and a rank's unsubmitted prompts wait in its queue.
- **Stop at enough.** Every rollout.agree_every engine steps one all-reduce sums the ranks' kept groups
  (and settles pulls); once they reach train_batch the stream stops and every request still running is
  aborted. The decision reads only the outputs, in their completion order, and the step count, never the
  clock: a fixed seed repeats bitwise. Why not every step: each agreement waits for the slowest rank, and
  on a loaded CPU such waits (scheduling, pack rebuilds at different steps) cost about as much as the
  steps themselves; the few steps run past the target are not lost (their groups roll into the next step,
  their tokens are carried). Between agreements a rank records only the engine steps that kept a group
  (`_Window`), so memory does not grow with agree_every; the step that met the target is found from those
  records (one gather, once per step) when the agreement sees it met.
- **Order.** Which groups are kept is decided by completion; their order is that of submission: a
  group's origin is (the sampler batch its prompt came from, counted over the run; rank; its position in
  the rank's share). So without an early stop the step trains on the groups rounds would, in the same
  order, and groups kept past the target roll into the next step ahead of anything newer.
- **Partial rollouts** (rollout.partial_rollouts): an aborted response is carried with its tokens, the
  policy version that sampled each token and its sampling log-probs; next step it is resubmitted with
  that prefix (prefilled under the new weights) and finishes. Its group waits for it, its siblings keep
  theirs. A carried response more than rollout.max_carry_steps versions old restarts from scratch. Such
  tokens train with the rollout correction against the log-prob of the version that sampled them
  (`algorithm.resolved_rollout_correction` turns token_truncate on). Without partial rollouts aborted
  responses and their groups are dropped: training then sees the short responses first (a length bias).
- **Nothing lost on resume**: the carried responses, waiting groups and the queue are this rank's
  `StreamState`, saved with every checkpoint (`checkpoint.py`). A resume with streaming turned off
  (`--rollout.streaming false --checkpoint.allow-changes rollout.streaming`) has no stream to put them in:
  they are dropped, and one line says how many (`dropped_streams_line`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...algorithm import rollout_correction_sums
from ...config import Config
from ...data import Prompt, PromptSampler
from ...distributed.collectives import all_gather_objects, all_reduce
from ...distributed.mesh import DistEnv
from ...profiling import StageTimer
from ...reward import Verifier
from ...rollout import Completion, Request, Rollouts, sampling_params
from ...seeds import derive_seed
from ..batch import Group
from .dealing import deal_kept
from .filter import check_shortfall, is_informative, report_round, unanimous
from .rounds import STREAM_KEY, Collected, score_groups


@dataclass
class Response:
    """A response of a pending group: what was sampled so far, by which policy version, at what log-prob."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    """[len] int64: the policy version that sampled each token."""
    finished: bool = False
    truncated: bool = False
    routes: torch.Tensor | None = None
    """Routing replay: the engine's experts of every position fed so far (its last completion's: each covers
    the prompt and every token before its last); None: not recorded."""


@dataclass
class PendingGroup:
    """A prompt whose n responses are being sampled (possibly across steps)."""

    prompt: Prompt
    responses: list[Response]
    origin: tuple[int, int, int]
    """(sampler batch, rank, position in the rank's share): the group's place in the canonical order."""

    @property
    def complete(self) -> bool:
        return all(r.finished for r in self.responses)


@dataclass
class StreamState:
    """This rank's stream between steps: saved with every checkpoint, so nothing is lost on resume."""

    pending: dict[int, PendingGroup] = field(default_factory=dict)
    """Groups with responses still to finish (carried), by key."""
    ready: list[Group] = field(default_factory=list)
    """Informative groups kept past the last step's target: first in line next step."""
    queue: list[tuple[tuple[int, int, int], Prompt]] = field(default_factory=list)
    """Prompts pulled from the sampler and not yet submitted, with their origins."""
    next_key: int = 0
    pulls: int = 0
    """Sampler batches pulled over the run (every rank pulls together)."""

    def to_plain(self) -> dict[str, Any]:
        """Plain containers (tensors, lists, dicts) for torch.save(weights_only)."""
        return {
            "pending": {
                k: {
                    "prompt": _prompt_plain(g.prompt), "origin": list(g.origin),
                    "responses": [vars(r).copy() for r in g.responses]
                }
                for k, g in self.pending.items()
            }, "ready": [g.to_plain() for g in self.ready],
            "queue": [[list(origin), _prompt_plain(p)] for origin, p in self.queue],
            "next_key": self.next_key, "pulls": self.pulls
        }

    @classmethod
    def from_plain(cls, data: dict[str, Any]) -> StreamState:
        pending = {int(k): PendingGroup(Prompt(**g["prompt"]), [Response(**r) for r in g["responses"]],
                                        tuple(g["origin"])) for k, g in data["pending"].items()}
        ready = [Group.from_plain(g) for g in data["ready"]]
        return cls(pending=pending, ready=ready, queue=[(tuple(o), Prompt(**p)) for o, p in data["queue"]],
                   next_key=int(data["next_key"]), pulls=int(data["pulls"]))


def dropped_streams_line(states: list[dict[str, Any] | None]) -> str | None:
    """The one line of a resume with rollout.streaming off from a checkpoint whose streams
    (`StreamState.to_plain` of every rank; None for a rank that saved none) hold work: how many pending and
    ready groups (and queued prompts) are dropped, and why. None when they hold nothing."""
    found = [s for s in states if s is not None]
    pending, ready, queued = (sum(len(s.get(part) or ()) for s in found)
                              for part in ("pending", "ready", "queue"))
    if not (pending or ready or queued):
        return None
    queue = f", {_count(queued, 'queued prompt')}" if queued else ""
    return (
        "rollout.streaming is off (checkpoint.allow_changes): the checkpoint's streams are dropped, not "
        "trained: "
        f"{_count(pending, 'pending group')}{' (their responses sampled so far)' if pending else ''}, "
        f"{_count(ready, 'ready group')}"
        f"{queue} (a rounds collector keeps no work between steps; their prompts are not drawn again this "
        "epoch)"
    )


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _prompt_plain(p: Prompt) -> dict[str, Any]:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


@dataclass
class StreamStats:
    """What the step's stream did (global figures): for the stream/* metrics."""

    ticks: int = 0
    generated_tokens: int = 0
    finished_groups: int = 0
    all_equal_groups: int = 0
    all_correct_groups: int = 0
    all_wrong_groups: int = 0
    carried: int = 0
    restarted: int = 0
    dropped: int = 0
    carried_age_max: int = 0
    ticks_after_target: int = 0
    """Engine steps run after the one after which train_batch groups were kept (over all ranks): until the
    ranks' next agreement."""
    wait_after_target_s: float = 0.0
    """From the end of the engine step after which train_batch groups were kept (over all ranks) to the end
    of the stream (the steps until the ranks agreed, then the abort and carry-over); the max over the ranks
    that kept a group in that engine step (the others did not record its time: `_Window`)."""


def stream_groups(step: int, state: StreamState, sampler: PromptSampler, engine, tokenizer,
                  verifier: Verifier, cfg: Config, env: DistEnv, timer: StageTimer, version: int,
                  deal=deal_kept, keep_generated: bool = False) -> tuple[Collected, StreamStats]:
    """Stream until train_batch informative groups are kept (globally), then deal them out; `state` carries
    what is left into the next step. `version`: the policy version sampling this step. `deal`: split
    placement's cut for the trainer side in place of `deal_kept` (split/rollout_side.py). `keep_generated`:
    Collected.generated lists this rank's groups of the step (for dumps): those kept past the last step's
    target, then every group that finished, each with whether the filter kept it."""
    rc, tc = cfg.rollout, cfg.trainer
    stats = StreamStats()
    sampling = sampling_params(rc, derive_seed(tc.seed, step, 1), n=1)  # one response per request
    kept: list[Group] = list(state.ready)  # kept past the last step's target: first in line
    generated = [(g, True) for g in state.ready]
    state.ready = []
    gen_sums = torch.zeros(4, dtype=torch.float64)  # correct, score, truncated, count over finished responses
    with timer("gen"):
        engine.open_stream(sampling)
        engine.submit(_resubmissions(state, version, cfg, stats, env.rank, step))
    pulls, met = _until_enough(step, state, sampler, engine, kept, generated, gen_sums, stats, tokenizer,
                               verifier, cfg, env, timer, version)
    with timer("gen"):
        _carry(state, engine.abort(), cfg, stats, version)
    if met is not None:
        stats.ticks_after_target = met[0]
        stats.wait_after_target_s = _clock() - met[1] if met[1] is not None else 0.0
    found = int(all_reduce(torch.tensor([len(kept)])).item())
    check_shortfall(step, found, f"{pulls} batches of {tc.gen_batch} prompts", cfg, env)
    mini_batches, leftover = deal([kept], cfg, env, with_leftover=True)
    if cfg.algorithm.dynamic_sampling:  # past the target: first in line next step, in order
        state.ready = leftover
    _reduce(stats)
    totals = all_reduce(gen_sums)
    count = max(totals[3].item(), 1.0)
    collected = Collected(
        mini_batches=mini_batches, num_gen_batches=pulls, groups_generated=stats.finished_groups,
        groups_informative=stats.finished_groups -
        stats.all_equal_groups if cfg.algorithm.dynamic_sampling else stats.finished_groups,
        gen_acc=totals[0].item() / count, gen_score=totals[1].item() / count,
        gen_truncated=totals[2].item() / count, groups_all_equal=stats.all_equal_groups,
        groups_all_correct=stats.all_correct_groups, groups_all_wrong=stats.all_wrong_groups,
        generated_samples=int(totals[3].item()), generated_tokens=stats.generated_tokens,
        generated=generated if keep_generated else [])
    return collected, stats


def _until_enough(step: int, state: StreamState, sampler: PromptSampler, engine, kept: list[Group],
                  generated: list[tuple[Group, bool]], gen_sums: torch.Tensor, stats: StreamStats, tokenizer,
                  verifier: Verifier, cfg: Config, env: DistEnv, timer: StageTimer,
                  version: int) -> tuple[int, tuple[int, float | None] | None]:
    """Top up, step the engine, score and filter finished groups into `kept` (and all of them, with whether
    kept, into `generated`), until train_batch are kept on all ranks together or nothing is left to run;
    the sampler batches pulled, and (engine steps run since, this rank's clock at) the end of the engine step
    after which the target was first met (None: never met; the clock None on a rank that kept no group in that
    step). The ranks agree (one all-reduce) every rollout.agree_every engine steps, so every rank takes every
    branch together; between agreements a rank tops up from its own queue."""
    per_rank = max(1, (cfg.rollout.max_in_flight or cfg.trainer.gen_batch) // env.world_size)
    every, target = cfg.rollout.agree_every, cfg.trainer.train_batch
    pulls, started, totals, due = 0, time.perf_counter(), None, True
    window = _Window(_clock(), len(kept))  # since the last agreement
    while True:
        with timer("gen"):
            more = _wants_more(totals, cfg)
            submitted = _top_up(state, engine, per_rank, cfg, env.rank, step) if more else 0
            if due or window.steps >= every:  # agree: the first time, after a pull, then every `every` steps
                due = False
                need_pull = more and not state.queue and len(state.pending) < per_rank
                totals = all_reduce(
                    torch.tensor(
                        [len(kept),
                         engine.pending(),
                         int(need_pull),
                         len(state.pending),
                         int(submitted)]))
                if int(totals[0]) >= target:
                    return pulls, window.met(target)
                window = _Window(_clock(), len(kept))
                if int(totals[2]) and (cfg.algorithm.max_gen_batches <= 0 or
                                       pulls < cfg.algorithm.max_gen_batches):
                    # a progress line on long steps; a warning every 20 unbounded pulls
                    if pulls and env.is_main:
                        report_round(step, pulls, int(totals[0]), cfg, time.perf_counter() - started)
                    state.pulls += 1  # some rank is out of prompts: every rank pulls the next batch
                    state.queue += [((state.pulls, env.rank, i), p)
                                    for i, p in enumerate(sampler.next_batch())]
                    pulls += 1
                    due = True  # agree again before the next engine step
                    continue
                # nothing in flight anywhere, nothing submitted
                if int(totals[1]) == 0 and not int(totals[4]):
                    return pulls, None
            stats.ticks += 1
            finished = engine.step()
        if finished:
            with timer("reward"):
                for group in _finish(state, finished, version, tokenizer, verifier, cfg, gen_sums, stats):
                    stats.finished_groups += 1
                    informative = is_informative(group, cfg.algorithm.filter_metric)
                    stats.all_equal_groups += not informative  # counted with or without the filter
                    correct, wrong = unanimous(group)
                    stats.all_correct_groups += correct
                    stats.all_wrong_groups += wrong
                    keep = informative or not cfg.algorithm.dynamic_sampling
                    if keep:
                        kept.append(group)
                    generated.append((group, keep))
        window.stepped(len(kept))


@dataclass
class _Window:
    """The engine steps since the ranks' last agreement, in memory that does not grow with
    rollout.agree_every: the kept count and clock at the agreement, and (step, kept count, clock) after each
    engine step that kept a group (at most one entry per group kept in the window)."""

    clock: float
    kept: int
    steps: int = 0
    rises: list[tuple[int, int, float]] = field(default_factory=list)

    def stepped(self, kept: int) -> None:
        """An engine step ran; `kept`: this rank's kept groups after it."""
        self.steps += 1
        if kept > (self.rises[-1][1] if self.rises else self.kept):
            self.rises.append((self.steps, kept, _clock()))

    def met(self, target: int) -> tuple[int, float | None]:
        """The target of kept groups (over all ranks) was met within the window: (engine steps run since the
        first step after which it was, this rank's clock at that step's end, None if this rank kept no group
        in it). Every rank calls this together: the ranks' rises are gathered (one collective)."""
        everyone = all_gather_objects((self.kept, [(s, k) for s, k, _ in self.rises]))
        first = first_step_reaching(target, everyone)
        if first == 0:
            return self.steps, self.clock
        return self.steps - first, next((clock for s, _, clock in self.rises if s == first), None)


def first_step_reaching(target: int, ranks: list[tuple[int, list[tuple[int, int]]]]) -> int:
    """The first engine step of a window (0: its start) after which the ranks' kept groups sum to `target`,
    from each rank's (kept at the start, [(step, kept after it) at each step that kept a group]); the window's
    end must reach it."""
    total = sum(start for start, _ in ranks)
    if total >= target:
        return 0
    changes: dict[int, int] = {}
    for start, rises in ranks:
        before = start
        for step, kept in rises:
            changes[step] = changes.get(step, 0) + kept - before
            before = kept
    for step in sorted(changes):
        total += changes[step]
        if total >= target:
            return step
    raise ValueError(f"first_step_reaching: the window's kept groups ({total}) never reach {target}")


def _clock() -> float:
    """The stream's clock (timing_s/wait_after_target); tests replace it with one that counts engine steps."""
    return time.perf_counter()


def _reduce(stats: StreamStats) -> None:
    """The step's stream figures summed (the carried age and the wait after the target: the max) over ranks,
    in place."""
    summed = all_reduce(torch.tensor([stats.finished_groups, stats.all_equal_groups, stats.all_correct_groups,
                                      stats.all_wrong_groups, stats.carried, stats.restarted, stats.dropped,
                                      stats.generated_tokens]))
    (stats.finished_groups, stats.all_equal_groups, stats.all_correct_groups, stats.all_wrong_groups,
     stats.carried, stats.restarted, stats.dropped, stats.generated_tokens) = (int(v)
                                                                               for v in summed.tolist())
    peaks = all_reduce(torch.tensor([stats.carried_age_max, stats.wait_after_target_s], dtype=torch.float64),
                       "max")
    stats.carried_age_max, stats.wait_after_target_s = int(peaks[0].item()), peaks[1].item()


def _wants_more(totals: torch.Tensor | None, cfg: Config) -> bool:
    """Whether to submit more prompts, from the last all-reduce (kept groups, requests and groups in flight):
    with dynamic sampling up to max_in_flight (some groups will be filtered out); without it every group
    trains, so no more than train_batch groups are ever kept or in flight (nothing to abort, as in rounds)."""
    if totals is None or cfg.algorithm.dynamic_sampling:
        return True
    return int(totals[0]) + int(totals[3]) < cfg.trainer.train_batch


def _in_flight(state: StreamState) -> int:
    return len(state.pending)


def _key(group: int, member: int, n: int) -> int:
    return group * n + member


def _top_up(state: StreamState, engine, per_rank: int, cfg: Config, rank: int, step: int) -> int:
    """Submit queued prompts while fewer than `per_rank` groups are pending; how many were submitted."""
    n, limit, submitted = cfg.rollout.n, cfg.rollout.max_response_length, 0
    requests = []
    while state.queue and len(state.pending) < per_rank:
        origin, prompt = state.queue.pop(0)
        key = state.next_key
        state.next_key += 1
        state.pending[key] = PendingGroup(prompt, [
            Response(torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0, dtype=torch.long))
            for _ in range(n)
        ], origin)
        requests += [Request(_key(key, m, n), tuple(prompt.ids), (), limit,
                             derive_seed(cfg.trainer.seed, step, rank, key, m)) for m in range(n)]
        submitted += 1
    if requests:
        engine.submit(requests)
    return submitted


def _resubmissions(state: StreamState, version: int, cfg: Config, stats: StreamStats, rank: int,
                   step: int) -> list[Request]:
    """The carried responses' requests (prefix = what they sampled), or a fresh start for those too old."""
    n, limit, out = cfg.rollout.n, cfg.rollout.max_response_length, []
    for key, group in state.pending.items():
        for m, r in enumerate(group.responses):
            if r.finished:
                continue
            age = version - int(r.versions.min()) if len(r.versions) else 0
            if age > cfg.rollout.max_carry_steps:
                stats.restarted += 1
                r.tokens, r.logprobs, r.versions, r.routes = r.tokens[:0], r.logprobs[:0], r.versions[:
                                                                                                      0], None
            stats.carried_age_max = max(stats.carried_age_max, age if len(r.tokens) else 0)
            out.append(Request(_key(key, m, n), tuple(group.prompt.ids), tuple(r.tokens.tolist()),
                               limit - len(r.tokens), derive_seed(cfg.trainer.seed, step, rank, key, m)))
    return out


def _finish(state: StreamState, completions: list[Completion], version: int, tokenizer, verifier: Verifier,
            cfg: Config, gen_sums: torch.Tensor, stats: StreamStats) -> list[Group]:
    """Record finished responses; the groups that became complete, scored (in key order)."""
    n, done = cfg.rollout.n, []
    for c in completions:
        stats.generated_tokens += len(c.tokens)
        key, member = divmod(c.key, n)
        _extend(state.pending[key].responses[member], c, version)
    for key in sorted({c.key // n for c in completions}):
        group = state.pending[key]
        if not group.complete:
            continue
        del state.pending[key]
        scored = _score(group, tokenizer, verifier, cfg)
        gen_sums += torch.tensor(
            [scored.acc.sum().item(),
             scored.scores.sum().item(),
             scored.truncated.sum().item(), scored.size], dtype=torch.float64)
        done.append(scored)
    return done


def _extend(response: Response, c: Completion, version: int) -> None:
    response.tokens = torch.cat([response.tokens, c.tokens])
    response.logprobs = torch.cat([response.logprobs, c.logprobs.float()])
    response.versions = torch.cat(
        [response.versions, torch.full((len(c.tokens), ), version, dtype=torch.long)])
    response.finished, response.truncated = c.finished, c.truncated
    if c.routes is not None:  # covers the whole sequence so far (a carried prefix re-prefilled included)
        response.routes = c.routes


def _score(group: PendingGroup, tokenizer, verifier: Verifier, cfg: Config) -> Group:
    rollouts = Rollouts(prompt_ids=[torch.tensor(group.prompt.ids, dtype=torch.long)] * len(group.responses),
                        response_ids=[r.tokens for r in group.responses],
                        group_ids=torch.zeros(len(group.responses), dtype=torch.long),
                        truncated=torch.tensor([r.truncated for r in group.responses], dtype=torch.bool),
                        logprobs=[r.logprobs for r in group.responses],
                        routes=[r.routes for r in group.responses] if all(r.routes is not None for r in
                                                                          group.responses) else None)
    # origin = (pull, rank, position): the pull count runs on over steps (and resumes), so it names the group.
    scored = score_groups(rollouts, [group.prompt], tokenizer, verifier, cfg,
                          [(STREAM_KEY, *group.origin)])[0]
    scored.versions = [r.versions for r in group.responses]
    scored.origin = group.origin
    return scored


def _carry(state: StreamState, aborted: list[Completion], cfg: Config, stats: StreamStats,
           version: int) -> None:
    """Keep what the aborted requests sampled (partial rollouts), or drop their groups."""
    n = cfg.rollout.n
    for c in aborted:
        key, member = divmod(c.key, n)
        response = state.pending[key].responses[member]
        if cfg.rollout.partial_rollouts:
            _extend(response, c, version)
            stats.carried += 1
        stats.generated_tokens += len(c.tokens)
    if not cfg.rollout.partial_rollouts:
        stats.dropped += len({c.key // n for c in aborted})
        for key in {c.key // n for c in aborted}:
            del state.pending[key]


def carries(cfg: Config) -> bool:
    """Whether trained tokens may come from older weights: streaming with partial rollouts."""
    return cfg.rollout.streaming and cfg.rollout.partial_rollouts


def stream_metrics(stats: StreamStats, batch, step: int, env: DistEnv) -> dict[str, float]:
    """stream/* metrics of one step (global): generated vs trained tokens, carried / restarted / dropped
    responses, the lag (in steps) of every trained token behind the weights it trains, the time the stream ran
    on after its target was met, the all-equal share of the finished groups."""
    lags = [step - v for g in batch.groups for v in (g.versions or [])]
    flat = torch.cat(lags) if lags else torch.zeros(0, dtype=torch.long)
    # The sp ranks of a sequence-parallel group hold the same responses: count one of them.
    speaks = float(env.sp_rank == 0)
    sums = all_reduce(torch.tensor([flat.numel() * speaks, flat.sum().item() * speaks], dtype=torch.float64))
    peak = int(all_reduce(torch.tensor([int(flat.max()) if flat.numel() else 0]), "max").item())
    trained = sums[0].item()
    return {
        **per_lag_metrics(batch, flat, speaks), "stream/ticks": float(stats.ticks),
        "stream/generated_tokens": float(stats.generated_tokens), "stream/trained_tokens": trained,
        "stream/generated_per_trained": stats.generated_tokens / max(trained, 1.0),
        "stream/carried": float(stats.carried), "stream/restarted": float(stats.restarted),
        "stream/dropped_groups": float(stats.dropped), "stream/carried_age_max": float(stats.carried_age_max),
        "stream/lag_mean": sums[1].item() / max(trained, 1.0), "stream/lag_max": float(peak),
        "stream/ticks_after_target": float(stats.ticks_after_target),
        "timing_s/wait_after_target": stats.wait_after_target_s,
        "stream/all_equal_fraction": stats.all_equal_groups / max(stats.finished_groups, 1)
    }


def per_lag_metrics(batch, lags: torch.Tensor, speaks: float) -> dict[str, float]:
    """The rollout correction's mean weight and the engine/trainer k3 KL over trained tokens sampled by this
    step's weights (lag 0) and by older ones (lag >= 1); empty without pi_old or engine log-probs."""
    sampled = [lp for g in batch.groups for lp in (g.sampler_logprobs or [])]
    if batch.old_logprobs is None or len(sampled) != len(batch.responses) or len(lags) != sum(
            map(len, sampled)):
        return {}
    def cat(parts: list[torch.Tensor]) -> torch.Tensor:  # a rank may hold no response (a short batch)
        return torch.cat(parts) if parts else torch.zeros(0)

    old, rollout, weights = cat(list(batch.old_logprobs)), cat(sampled), cat(list(batch.rollout_weights))
    valid = torch.repeat_interleave(batch.loss_mask.bool(), batch.responses_lengths_tensor())
    out = {}
    for name, bucket in (("lag0", lags == 0), ("lag1plus", lags >= 1)):
        sums, _ = rollout_correction_sums(old, rollout, weights, valid & bucket)
        sums = all_reduce(sums * speaks)
        out[f"stream/{name}_tokens"] = sums[0].item()
        out[f"stream/{name}_weight_mean"] = sums[2].item() / max(sums[3].item(), 1.0)
        out[f"stream/{name}_k3_kl"] = sums[4].item() / max(sums[0].item(), 1.0)
    return out

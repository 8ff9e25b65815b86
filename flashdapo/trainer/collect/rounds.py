"""Steps 1-4 of the DAPO walk: sample prompts, roll out, score, and dynamic sampling.

Dynamic sampling is decided globally: every rank generates for its shard of `gen_batch` prompts,
keeps its informative groups (their `algorithm.filter_metric` values not all equal), and the kept
counts are summed over ranks; rounds repeat until `train_batch` groups are kept in total (bounded by
`max_gen_batches`). The kept groups are then ordered (round, rank, position), truncated to exactly
`train_batch`, cut into global mini-batches as one rank would, and each mini-batch's responses dealt to the
data-parallel slots balanced by tokens (`dealing.py`): the optimizer steps are those one rank would take. Without dynamic sampling every generated group trains (the config
requires gen_batch = train_batch).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ...algorithm import informative_groups, shaped_scores
from ...config import Config
from ...data import Prompt, PromptSampler
from ...distributed.collectives import all_gather_objects, all_reduce
from ...distributed.mesh import DistEnv
from ...errors import FlashdapoError
from ...profiling import StageTimer
from ...reward import RandomReward, Verifier, check_reward, verify_responses
from ...rollout import RolloutEngine, Rollouts, SamplingParams
from ...seeds import derive_seed
from ..batch import Group
from .dealing import deal_to_slots

ROUNDS_KEY, STREAM_KEY = 1, 2
"""First part of a random reward's key: a generation round's group, or a streamed group (streaming.py)."""


class DynamicSamplingError(FlashdapoError, RuntimeError):
    """max_gen_batches rounds did not find train_batch informative groups (on_max_gen_batches=error)."""


@dataclass
class Collected:
    """This rank's share of the step's kept groups, per mini-batch, and what the search cost (global figures)."""

    mini_batches: list[list[Group]]
    """This rank's groups (or pieces of them) of each mini-batch, as `dealing.deal_to_slots` dealt them."""
    num_gen_batches: int
    groups_generated: int
    groups_informative: int
    gen_acc: float
    gen_score: float
    gen_truncated: float
    """Fraction of all generated responses that hit the max length."""
    groups_all_equal: int = 0
    """Finished groups whose filter values were all equal (dynamic sampling drops them; counted without it too)."""
    groups_all_correct: int = 0
    """Finished groups of two or more responses all judged correct (counted with or without dynamic sampling)."""
    groups_all_wrong: int = 0
    """Finished groups of two or more responses all judged wrong."""
    generated_samples: int = 0
    """Responses the engine finished for this step, kept or not, over all ranks."""
    generated_tokens: int = 0
    """Response tokens the engine sampled for this step, kept or not, over all ranks."""
    generated: list[tuple[Group, bool]] = field(default_factory=list)
    """With keep_generated: every group this rank generated, and whether the filter kept it (for dumps)."""

    @property
    def groups(self) -> list[Group]:
        """This rank's kept groups, mini-batch after mini-batch."""
        return [g for part in self.mini_batches for g in part]


def score_groups(rollouts: Rollouts, prompts: list[Prompt], tokenizer, verifier: Verifier | RandomReward, cfg: Config,
                 keys: Sequence[tuple[int, ...]] = ()) -> list[Group]:
    """Verify every response, add the overlong penalty, and bundle responses per prompt. A RandomReward
    `verifier` draws each response's verdict from its prompt's key in `keys` (one per prompt, naming it in
    the run) and its member index, not from its text."""
    truths = [prompts[int(g)].ground_truth for g in rollouts.group_ids]
    if isinstance(verifier, RandomReward):
        if len(keys) != len(prompts):
            raise ValueError(f"score_groups: the random reward needs one key per prompt, got {len(keys)} for "
                             f"{len(prompts)} prompts")
        texts, verdicts = [""] * len(truths), [None] * len(truths)
        for p in range(len(prompts)):
            for member, i in enumerate((rollouts.group_ids == p).nonzero().flatten().tolist()):
                verdicts[i] = verifier.verdict(*keys[p], member)
    else:
        texts, verdicts = verify_responses(rollouts.response_ids, truths, tokenizer, verifier)
    acc = torch.tensor([v.acc for v in verdicts], dtype=torch.bool)
    scores = shaped_scores(torch.tensor([v.score for v in verdicts]), rollouts.response_lengths,
                           cfg.rollout.max_response_length, cfg.algorithm)
    for i in (~torch.isfinite(scores)).nonzero().flatten().tolist():  # one NaN reward poisons its whole group
        check_reward(scores[i].item(), prompts[int(rollouts.group_ids[i])].source, texts[i])
    groups = []
    for p in range(len(prompts)):
        idx = (rollouts.group_ids == p).nonzero().flatten().tolist()
        groups.append(Group(
            prompt=rollouts.prompt_ids[idx[0]],
            responses=[rollouts.response_ids[i] for i in idx],
            scores=scores[idx],
            acc=acc[idx],
            truncated=rollouts.truncated[idx],
            sampler_logprobs=None if rollouts.logprobs is None else [rollouts.logprobs[i] for i in idx],
        ))
    return groups


def _is_informative(group: Group, metric: str) -> bool:
    values = group.acc if metric == "acc" else group.scores
    return bool(informative_groups(values, torch.zeros(group.size, dtype=torch.long)).all())


def unanimous(group: Group) -> tuple[int, int]:
    """(1, 0) when every response of the group is correct, (0, 1) when every one is wrong, else (0, 0); a
    group of one response is neither (as dynamic sampling keeps it, it is never all-equal either)."""
    if group.size < 2:
        return 0, 0
    return int(bool(group.acc.all())), int(not bool(group.acc.any()))


def collect_groups(step: int, sampler: PromptSampler, engine: RolloutEngine, tokenizer, verifier: Verifier,
                   cfg: Config, env: DistEnv, timer: StageTimer, keep_generated: bool = False,
                   carried: Sequence[Group] = (), deal=None) -> Collected:
    """Generate rounds until train_batch informative groups are kept (globally), then deal them out.
    `keep_generated` also returns every generated group (Collected.generated). Split placement
    (`split_rollout.py`): `carried`, this rank's informative groups kept past the last batch's target, first
    in line (round 0); no round runs when they already fill train_batch; `deal` replaces `_deal_out`."""
    tc, algo = cfg.trainer, cfg.algorithm
    kept_per_round: list[list[Group]] = [list(carried)] if carried else []
    generated: list[tuple[Group, bool]] = []
    # Every rank of split placement's rollout side passes `deal` (and its carried groups, maybe none) together.
    total_kept = int(all_reduce(torch.tensor([len(carried)])).item()) if deal is not None else 0
    carried_total = total_kept
    rounds = all_equal = 0
    unanimity = torch.zeros(2, dtype=torch.long)  # all-correct, all-wrong groups (this rank)
    started = time.perf_counter()
    # Sums over all generated responses (this rank): correct, score, truncated, count, tokens.
    gen_sums = torch.zeros(5, dtype=torch.float64)
    while total_kept < tc.train_batch:
        rounds += 1
        prompts = sampler.next_batch()
        sampling = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_response_length,
                                  seed=derive_seed(tc.seed, step, rounds))
        with timer("gen"):
            rollouts = engine.generate([p.ids for p in prompts], sampling)
        with timer("reward"):
            # The random reward's key of each prompt: its place in the run (rounds restart every step).
            keys = [(ROUNDS_KEY, step, rounds, env.rank, i) for i in range(len(prompts))]
            groups = score_groups(rollouts, prompts, tokenizer, verifier, cfg, keys)
        for g in groups:
            gen_sums += torch.tensor([g.acc.sum().item(), g.scores.sum().item(), g.truncated.sum().item(), g.size,
                                      sum(len(r) for r in g.responses)], dtype=torch.float64)
        for i, g in enumerate(groups):
            g.origin = (rounds, env.rank, i)
        informative = [g for g in groups if _is_informative(g, algo.filter_metric)]
        all_equal += len(groups) - len(informative)  # counted with or without the filter
        for g in groups:
            unanimity += torch.tensor(unanimous(g))
        kept = informative if algo.dynamic_sampling else groups
        kept_per_round.append(kept)
        if keep_generated:
            generated += [(g, any(g is k for k in kept)) for g in groups]
        total_kept += int(all_reduce(torch.tensor([len(kept)])).item())
        if total_kept >= tc.train_batch or not algo.dynamic_sampling:
            break
        if 0 < algo.max_gen_batches <= rounds:
            message = (f"step {step}: dynamic sampling found {total_kept} informative groups in {rounds} "
                       f"generation rounds ({rounds * tc.gen_batch} prompts); train_batch needs {tc.train_batch}")
            if algo.on_max_gen_batches == "error":
                raise DynamicSamplingError(message + ". The data may be too easy or too hard for the model: raise "
                                           "algorithm.max_gen_batches, or set algorithm.on_max_gen_batches=continue")
            if env.is_main:
                usable = min(total_kept, tc.train_batch) // env.dp_size * env.dp_size
                warnings.warn(message + f"; training on what was found (on_max_gen_batches=continue): {usable} groups "
                              f"in {-(-usable // tc.mini_batch)} mini-batches of up to {tc.mini_batch} (instead of "
                              f"{tc.train_batch // tc.mini_batch})", stacklevel=2)
            break
        if env.is_main:
            _report_round(step, rounds, total_kept, cfg, time.perf_counter() - started)
    totals = all_reduce(gen_sums)
    count = max(totals[3].item(), 1.0)
    all_equal, all_correct, all_wrong = (int(v) for v in all_reduce(torch.cat([torch.tensor([all_equal]),
                                                                                unanimity])).tolist())
    return Collected(
        mini_batches=(deal or _deal_out)(kept_per_round, cfg, env),
        num_gen_batches=rounds,
        groups_generated=rounds * tc.gen_batch,
        groups_informative=total_kept - carried_total,  # found this step (the carried were counted before)
        gen_acc=totals[0].item() / count,
        gen_score=totals[1].item() / count,
        gen_truncated=totals[2].item() / count,
        groups_all_equal=all_equal,
        groups_all_correct=all_correct,
        groups_all_wrong=all_wrong,
        generated_samples=int(totals[3].item()),
        generated_tokens=int(totals[4].item()),
        generated=generated,
    )


UNBOUNDED_WARN_EVERY = 20
"""With max_gen_batches <= 0 (unbounded), warn every this many generation rounds of one step."""
ROUND_LINE_AFTER_S = 10.0
"""A step's extra generation rounds print their progress line once its generation has run this long: a
real run's rounds take minutes and the line says why the step is long; the toy's take 0.2 s and the step
line's `rounds N` says enough."""


def _report_round(step: int, rounds: int, kept: int, cfg: Config, elapsed_s: float) -> None:
    """Before each extra generation round: a progress line (logging.progress) once the step's generation has
    run ROUND_LINE_AFTER_S; when unbounded, a warning every UNBOUNDED_WARN_EVERY rounds with the kept rate,
    so a search that cannot end is visible."""
    tc = cfg.trainer
    if cfg.logging.progress and elapsed_s >= ROUND_LINE_AFTER_S:
        print(f"flashdapo: step {step}: generation round {rounds + 1}: {kept} of {tc.train_batch} informative "
              "groups kept so far", flush=True)
    if cfg.algorithm.max_gen_batches <= 0 and rounds % UNBOUNDED_WARN_EVERY == 0:
        rate = kept / (rounds * tc.gen_batch)
        outlook = (f"about {-(-(tc.train_batch - kept) * rounds // kept)} more rounds at this rate" if kept
                   else "it may never end")
        warnings.warn(f"step {step}: {rounds} generation rounds kept {kept} of {rounds * tc.gen_batch} groups "
                      f"({rate:.1%}); train_batch needs {tc.train_batch}: {outlook}. algorithm.max_gen_batches=0 is "
                      "unbounded: set it to a bound to stop or continue at that bound", stacklevel=3)


def _deal_out(kept_per_round: list[list[Group]], cfg: Config, env: DistEnv,
              with_leftover: bool = False):
    """Order kept groups by origin (round or tick, rank, position), keep the first train_batch (or, when
    short, the largest multiple of the data-parallel size), and deal this data-parallel slot its responses of
    every global mini-batch (the ranks of a sequence-parallel group share a slot: the same responses).
    `with_leftover`: also this rank's own kept groups that did not make the cut, in order."""
    everyone = all_gather_objects(kept_per_round) if env.world_size > 1 else [kept_per_round]
    ordered = sorted((g for rank_rounds in everyone for rnd in rank_rounds for g in rnd), key=lambda g: g.origin)
    usable = min(len(ordered), cfg.trainer.train_batch) // env.dp_size * env.dp_size
    dealt = deal_to_slots(ordered[:usable], cfg.trainer.mini_batch, env.dp_size, env.dp_rank,
                          cfg.algorithm.advantage_eps)
    if not with_leftover:
        return dealt
    cut = {g.origin for g in ordered[:usable]}
    return dealt, [g for rnd in kept_per_round for g in rnd if g.origin not in cut]

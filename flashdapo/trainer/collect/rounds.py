"""Steps 1-4 of one training step (docs/architecture.md, "One training step"): sample prompts, roll out,
score, and dynamic sampling.

Dynamic sampling is decided globally: every rank generates for its shard of `gen_batch` prompts,
keeps its informative groups (their `algorithm.filter_metric` values not all equal), and the kept
counts are summed over ranks; rounds repeat until `train_batch` groups are kept in total (bounded by
`max_gen_batches`). The kept groups are then ordered (round, rank, position), truncated to exactly
`train_batch`, cut into global mini-batches as one rank would, and each mini-batch's responses dealt to the
data-parallel slots balanced by tokens (`dealing.py`): the optimizer steps are those one rank would take.
Without dynamic sampling every generated group trains (the config requires gen_batch = train_batch).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from ...algorithm import shaped_scores
from ...config import Config
from ...data import Prompt, PromptSampler
from ...distributed.collectives import all_reduce
from ...distributed.mesh import DistEnv
from ...profiling import StageTimer
from ...reward import RandomReward, Verifier, check_reward, verify_responses
from ...rollout import RolloutEngine, Rollouts, sampling_params
from ...seeds import derive_seed
from ..batch import Group
from .dealing import deal_kept
from .filter import check_shortfall, is_informative, report_round, unanimous

ROUNDS_KEY, STREAM_KEY = 1, 2
"""First part of a random reward's key: a generation round's group, or a streamed group (streaming.py)."""


@dataclass
class Collected:
    """This rank's share of the step's kept groups, per mini-batch, and what the search cost (global
    figures)."""

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
    """Finished groups whose filter values were all equal (dynamic sampling drops them; counted without it
    too)."""
    groups_all_correct: int = 0
    """Finished groups of two or more responses all judged correct (counted with or without dynamic
    sampling)."""
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

    def figures(self) -> dict[str, int | float]:
        """What the search cost, as plain numbers (every field but the groups): the one codec of these
        figures, which split placement sends with each batch."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _GROUP_FIELDS}

    @classmethod
    def from_figures(cls, figures: dict[str, int | float], mini_batches: list[list[Group]]) -> Collected:
        """`figures()` read back, around this rank's dealt `mini_batches`."""
        return cls(mini_batches=mini_batches, **{name: figures[name] for name in figures
                                                 if name not in _GROUP_FIELDS})


_GROUP_FIELDS = ("mini_batches", "generated")


def score_groups(rollouts: Rollouts, prompts: list[Prompt], tokenizer, verifier: Verifier | RandomReward,
                 cfg: Config, keys: Sequence[tuple[int, ...]] = ()) -> list[Group]:
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
            routes=None if rollouts.routes is None else [rollouts.routes[i] for i in idx],
        ))
    return groups


def collect_groups(step: int, sampler: PromptSampler, engine: RolloutEngine, tokenizer, verifier: Verifier,
                   cfg: Config, env: DistEnv, timer: StageTimer, keep_generated: bool = False,
                   carried: Sequence[Group] = (), deal=None) -> Collected:
    """Generate rounds until train_batch informative groups are kept (globally), then deal them out.
    `keep_generated` also returns every generated group (Collected.generated). Split placement
    (trainer/split/rollout_side.py): `carried`, this rank's informative groups kept past the last batch's
    target, first in line (round 0); no round runs when they already fill train_batch; `deal` replaces
    `deal_kept`."""
    tc, algo = cfg.trainer, cfg.algorithm
    kept_per_round: list[list[Group]] = [list(carried)] if carried else []
    generated: list[tuple[Group, bool]] = []
    # Every rank of split placement's rollout side passes `deal` (and its carried groups, maybe none)
    # together.
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
        sampling = sampling_params(cfg.rollout, derive_seed(tc.seed, step, rounds))
        with timer("gen"):
            rollouts = engine.generate([p.ids for p in prompts], sampling)
        with timer("reward"):
            # The random reward's key of each prompt: its place in the run (rounds restart every step).
            keys = [(ROUNDS_KEY, step, rounds, env.rank, i) for i in range(len(prompts))]
            groups = score_groups(rollouts, prompts, tokenizer, verifier, cfg, keys)
        for g in groups:
            gen_sums += torch.tensor([
                g.acc.sum().item(),
                g.scores.sum().item(),
                g.truncated.sum().item(), g.size,
                sum(len(r) for r in g.responses)
            ], dtype=torch.float64)
        for i, g in enumerate(groups):
            g.origin = (rounds, env.rank, i)
        informative = [g for g in groups if is_informative(g, algo.filter_metric)]
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
            check_shortfall(step, total_kept, f"{rounds} generation rounds ({rounds * tc.gen_batch} prompts)",
                            cfg, env)
            break
        if env.is_main:
            report_round(step, rounds, total_kept, cfg, time.perf_counter() - started)
    totals = all_reduce(gen_sums)
    count = max(totals[3].item(), 1.0)
    all_equal, all_correct, all_wrong = (int(v) for v in all_reduce(torch.cat([torch.tensor([all_equal]),
                                                                                unanimity])).tolist())
    return Collected(
        mini_batches=(deal or deal_kept)(kept_per_round, cfg, env),
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

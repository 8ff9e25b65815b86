"""Sampling an evaluation set: k responses per prompt, sharded over ranks, judged, gathered in rounds.

The choices, stated first:
- Prompts still to do (not in `skip`) are dealt out in rounds: in each round every rank takes the next
  `prompts_per_call` prompts, makes ONE `engine.generate` call for them, and judges its responses;
  then the round's results are all-gathered (every rank returns the same list) and handed to
  `on_round` (rank 0 appends them to samples.jsonl). The last round is padded with a repeat of a
  prompt whose results are dropped, so every rank makes the same number of generate calls (an
  FSDP2-sharded or tensor-parallel engine runs collectives inside generate).
- Seeds: a call's seed is `derive_seed(seed, first prompt id of the call)`. With one prompt per call
  (the default) a prompt's samples therefore depend only on (seed, prompt id), not on the world
  size, the rank or what was already done: 1 and N ranks, and killed-then-resumed runs, sample the
  same tokens with an engine whose draws do not depend on the rank (the torch engine without a
  process group, which seeds as rank 0). An FSDP2-sharded torch engine mixes its rank into the seed,
  and more prompts per call (what vLLM wants) keeps runs repeatable for a fixed world size and set of
  pending prompts only.
- Progress (rank 0): prompts done / total, response tokens per second, and the ETA (tqdm).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from ..data import Prompt
from ..distributed.collectives import all_gather_objects, broadcast_object
from ..reward import Verifier, verify_responses
from ..rollout import RolloutEngine, Rollouts, SamplingParams
from ..seeds import derive_seed
from .results import EvalReport, PromptResult, SampleResult, summarize
from .store import EvalStoreError, SampleLog


@dataclass(frozen=True)
class EvalSampling:
    """How an evaluation samples (DAPO: k = 32, temperature 1.0, top_p 0.7, up to 20480 tokens)."""

    k: int = 32
    temperature: float = 1.0
    top_p: float = 0.7
    top_k: int = -1
    max_new_tokens: int = 20480
    seed: int = 0
    prompts_per_call: int = 1
    """Prompts each rank passes to one engine.generate call (and results written per round)."""


@dataclass(frozen=True)
class Shard:
    """This process's place among the ranks that share the evaluation."""

    rank: int = 0
    world_size: int = 1


def judge(rollouts: Rollouts, prompts: list[Prompt], ids: list[int], tokenizer, verifier: Verifier,
          k: int) -> list[PromptResult]:
    """Decode and verify the k responses of each prompt (responses of prompt j at rows j*k..j*k+k-1)."""
    texts, verdicts = verify_responses(rollouts.response_ids,
                                       [p.ground_truth for p in prompts for _ in range(k)], tokenizer,
                                       verifier)
    results = []
    for j, (pid, prompt) in enumerate(zip(ids, prompts)):
        samples = []
        for row in range(j * k, (j + 1) * k):
            verdict = verdicts[row]
            samples.append(SampleResult(response=texts[row], pred=verdict.pred, score=verdict.score,
                                        acc=verdict.acc, length=len(rollouts.response_ids[row]),
                                        finish_reason="length" if bool(rollouts.truncated[row]) else "stop"))
        results.append(PromptResult(prompt_id=pid, source=prompt.source, data_source=prompt.data_source,
                                    ground_truth=prompt.ground_truth, samples=samples,
                                    prompt=tokenizer.decode(prompt.ids, skip_special_tokens=False)))
    return results


def _rounds(pending: list[int], per_call: int, world: int) -> list[list[list[int]]]:
    """rounds[r][rank] = the prompt ids rank `rank` generates in round r; -1 marks padding."""
    per_round = per_call * world
    padded = pending + [-1] * (-len(pending) % per_round)
    return [[padded[r + i * per_call:r + (i + 1) * per_call] for i in range(world)]
            for r in range(0, len(padded), per_round)]


def sample_prompts(engine: RolloutEngine, prompts: list[Prompt], tokenizer, verifier: Verifier,
                   sampling: EvalSampling, shard: Shard = Shard(), skip: set[int] | frozenset = frozenset(),
                   on_round: Callable[[list[PromptResult]], None] | None = None,
                   progress: bool = False) -> list[PromptResult]:
    """Sample and judge every prompt whose id (index in `prompts`) is not in `skip`; returns their results,
    ordered by prompt id, on every rank. Every rank must call this with the same arguments."""
    pending = [i for i in range(len(prompts)) if i not in skip]
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(pending), unit="prompt", dynamic_ncols=True,
               disable=not progress or shard.rank != 0, desc="eval")
    start, tokens, done = time.perf_counter(), 0, []
    try:
        for assignment in _rounds(pending, sampling.prompts_per_call, shard.world_size):
            mine = assignment[shard.rank]
            real = [i for i in mine if i >= 0]
            ids = real or [assignment[0][0]]  # an all-padding share repeats a real prompt
            params = SamplingParams(n=sampling.k, temperature=sampling.temperature, top_p=sampling.top_p,
                                    top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens,
                                    seed=derive_seed(sampling.seed, ids[0]))
            rollouts = engine.generate([prompts[i].ids for i in ids], params)
            local = judge(rollouts, [prompts[i] for i in ids], ids, tokenizer, verifier,
                          sampling.k)[:len(real)]
            merged = sorted((r for part in all_gather_objects(local) for r in part),
                            key=lambda r: r.prompt_id)
            if on_round is not None:
                on_round(merged)
            done += merged
            tokens += sum(s.length for r in merged for s in r.samples)
            bar.update(len(merged))
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.0f} tok/s")
    finally:
        bar.close()
    return done


def evaluate_to_dir(engine: RolloutEngine, prompts: list[Prompt], tokenizer, verifier: Verifier,
                    sampling: EvalSampling, log: SampleLog | None, shard: Shard = Shard(),
                    progress: bool = True) -> EvalReport:
    """Evaluate into `log`'s directory (samples.jsonl, eval_settings.json, metrics.json), resuming what is
    there. Rank 0 holds the open `log` (opened before the model loads, so a wrong OUT fails first) and reads
    and writes the files; other ranks pass None. Every rank samples its share and returns the same report."""
    done, error = [], ""
    if log is not None:
        try:
            done = log.load(prompts)
        except EvalStoreError as err:
            error = str(err)
    error, done_ids = broadcast_object((error, sorted(r.prompt_id for r in done)))
    if error:
        raise EvalStoreError(error)
    if done_ids and shard.rank == 0:
        print(f"flashdapo eval: resuming, {len(done_ids)} of {len(prompts)} prompts already in "
              f"{log.path}", flush=True)
    start = time.perf_counter()
    new = sample_prompts(engine, prompts, tokenizer, verifier, sampling, shard, set(done_ids),
                         on_round=log.append if log is not None else None, progress=progress)
    report = summarize(done + new) if shard.rank == 0 else None
    if log is not None:
        log.write_metrics(report, {"settings": log.settings, "wall_time_s": time.perf_counter() - start,
                                   "prompts_sampled_now": len(new), "world_size": shard.world_size})
    return broadcast_object(report)

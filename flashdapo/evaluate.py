"""Evaluation as DAPO reports it: k samples per prompt (temperature 1.0, top_p 0.7), mean@k (avg@k),
pass@k and maj@k, scored by the same verifier as training.

Used by the trainer's validation (every rank samples its share of the prompts) and by
`flashdapo eval` (eval_command.py) for a saved model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .data import Prompt
from .reward import Verdict, Verifier
from .rollout import RolloutEngine, SamplingParams
from .trainer.distributed import all_gather_objects


@dataclass
class EvalResult:
    """Per-prompt verdicts of k samples, and the summary metrics."""

    k: int
    verdicts: list[list[Verdict]]
    """verdicts[prompt][sample]."""
    response_lengths: list[int]
    truncated: int

    @property
    def mean_at_k(self) -> float:
        flat = [v.acc for row in self.verdicts for v in row]
        return sum(flat) / max(len(flat), 1)

    @property
    def pass_at_k(self) -> float:
        return sum(any(v.acc for v in row) for row in self.verdicts) / max(len(self.verdicts), 1)

    @property
    def maj_at_k(self) -> float:
        return sum(_majority_correct(row) for row in self.verdicts) / max(len(self.verdicts), 1)

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        lengths = torch.tensor(self.response_lengths, dtype=torch.float64)
        return {
            f"{prefix}/acc/mean@k": self.mean_at_k,
            f"{prefix}/acc/pass@k": self.pass_at_k,
            f"{prefix}/acc/maj@k": self.maj_at_k,
            f"{prefix}/k": float(self.k),
            f"{prefix}/response_length/mean": lengths.mean().item() if len(lengths) else 0.0,
            f"{prefix}/response_length/clip_ratio": self.truncated / max(len(self.response_lengths), 1),
        }


def _majority_correct(row: list[Verdict]) -> bool:
    """Majority vote over the extracted (normalized) answers; invalid extractions do not vote."""
    votes = Counter(v.pred for v in row if v.pred)
    if not votes:
        return False
    winner, _ = votes.most_common(1)[0]  # ties: the answer seen first (Counter keeps insertion order)
    return any(v.acc for v in row if v.pred == winner)


def evaluate(engine: RolloutEngine, prompts: list[Prompt], tokenizer, verifier: Verifier, k: int,
             temperature: float, top_p: float, max_new_tokens: int, seed: int) -> EvalResult:
    """Sample k responses per prompt with `engine` and score them; with several ranks, each rank samples
    its round-robin share (padded so every rank runs the same number of prompts) and results are gathered.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank = -(-len(prompts) // world)
    mine = [(i, prompts[i % len(prompts)]) for i in range(rank, per_rank * world, world)]
    sampling = SamplingParams(n=k, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                              seed=seed)
    rollouts = engine.generate([p.ids for _, p in mine], sampling)
    texts = tokenizer.batch_decode([r.tolist() for r in rollouts.response_ids], skip_special_tokens=True)
    local = []
    for j, (index, prompt) in enumerate(mine):
        rows = range(j * k, (j + 1) * k)
        local.append((index, [verifier(texts[r], prompt.ground_truth) for r in rows],
                      [len(rollouts.response_ids[r]) for r in rows],
                      int(rollouts.truncated[list(rows)].sum())))
    gathered = sorted((item for part in all_gather_objects(local) for item in part), key=lambda t: t[0])
    gathered = [item for item in gathered if item[0] < len(prompts)]  # drop the padding
    return EvalResult(k=k, verdicts=[g[1] for g in gathered],
                      response_lengths=[n for g in gathered for n in g[2]],
                      truncated=sum(g[3] for g in gathered))

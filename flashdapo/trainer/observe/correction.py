"""How far the rollout engine's sampling distribution is from the trainer's, and what the rollout
correction did about it: the `rollout_corr/*` metrics of one step, over all ranks.

The engine samples from its own computation of the policy (vLLM: bf16 kernels, its own sampler); the
trainer recomputes pi_old. `algorithm.rollout_correction` turns their per-token ratio into a detached
factor on each token's loss (`TrainBatch.rollout_weights`, docs/algorithm.md, "Rollout correction").
"""

from __future__ import annotations

import torch

from ...algorithm import rollout_correction_sums
from ...distributed.collectives import all_reduce
from ..batch import TrainBatch


def rollout_correction_metrics(batch: TrainBatch) -> dict[str, float]:
    """Over the loss tokens of all ranks: the correction's weight mean / min / max (over the tokens it kept),
    the fraction it masked, and the k3 estimate of KL(rollout || old). Empty when the engine reports no
    log-probs."""
    sampled = [lp for g in batch.groups for lp in (g.sampler_logprobs or [])]
    if len(sampled) != len(batch.responses):
        return {}
    lengths = batch.responses_lengths_tensor()
    flat = [torch.cat(parts) if parts else torch.zeros(0) for parts in (list(batch.old_logprobs), sampled,
                                                                          list(batch.rollout_weights))]
    valid = torch.repeat_interleave(batch.loss_mask.bool(), lengths)
    sums, extremes = rollout_correction_sums(*flat, valid)
    sums, extremes = all_reduce(sums).tolist(), all_reduce(extremes, "max").tolist()
    tokens, kept = max(sums[0], 1.0), sums[3]
    return {"rollout_corr/weight_mean": sums[2] / max(kept, 1.0),
            "rollout_corr/weight_min": -extremes[0] if kept else 0.0,
            "rollout_corr/weight_max": extremes[1] if kept else 0.0,
            "rollout_corr/masked_fraction": sums[1] / tokens,
            "rollout_corr/k3_kl": sums[4] / tokens}

"""The metrics of one training step, named as verl names them (docs/algorithm.md, section 8), global over
ranks."""

from __future__ import annotations

import torch

from ...distributed.collectives import all_gather_objects, all_reduce
from ...distributed.mesh import DistEnv
from ...profiling import StageTimer
from ..batch import TrainBatch
from ..collect.rounds import Collected
from ..update import UpdateResult
from .sinks import describe


def step_metrics(step: int, batch: TrainBatch, collected: Collected, update: UpdateResult, timer: StageTimer,
                 env: DistEnv, n: int) -> dict[str, float]:
    """verl-named metrics of one step (docs/algorithm.md, section 8), global over ranks; `n`: responses per
    prompt (rollout.n)."""
    local = (batch.scores, batch.advantages, batch.responses_lengths_tensor(), batch.prompt_lengths_tensor(),
             batch.truncated.float(), batch.acc)
    # The sp ranks of a sequence-parallel group hold the same responses: the first of each speaks for it.
    slots = all_gather_objects(local)[::env.sequence_parallel]
    scores, adv, resp_len, prompt_len, trunc, acc = (torch.cat(parts) for parts in zip(*slots))
    means = update.stats.means()
    tokens = (resp_len.sum() + prompt_len.sum()).item()
    seconds = timer.seconds["step"]
    m = {
        "step": step,
        **describe("critic/score", scores),
        "critic/rewards/mean": scores.mean().item() if len(scores) else 0.0,
        **describe("critic/advantages", adv),
        **describe("response_length", resp_len),
        "response_length/clip_ratio": trunc.mean().item() if len(trunc) else 0.0,
        "prompt_length/mean": prompt_len.float().mean().item() if len(prompt_len) else 0.0,
        "prompt_length/max": prompt_len.float().max().item() if len(prompt_len) else 0.0,
        "actor/pg_loss": sum(update.pg_losses) / max(len(update.pg_losses), 1),
        "actor/entropy": means["entropy"],
        "actor/pg_clipfrac": means["pg_clipfrac"],
        "actor/pg_clipfrac_lower": means["pg_clipfrac_lower"],
        "actor/ppo_kl": means["ppo_kl"],
        **split_metrics(means, acc, resp_len),
        "actor/token_prob": means["token_prob"],
        "actor/ratio": means["ratio"],
        "actor/grad_norm": sum(update.grad_norms) / max(len(update.grad_norms), 1),
        **router_metrics(update),
        "train/num_gen_batches": collected.num_gen_batches,
        "train/kept_fraction": collected.groups_informative / max(collected.groups_generated, 1),
        "train/kept_groups": float(len(scores) // n),
        # Groups whose filter values were all equal, of those generated: what dynamic sampling drops (or,
        # without it, trains on with zero advantage).
        "train/all_equal_fraction": collected.groups_all_equal / max(collected.groups_generated, 1),
        "train/all_correct_fraction": collected.groups_all_correct / max(collected.groups_generated, 1),
        "train/all_wrong_fraction": collected.groups_all_wrong / max(collected.groups_generated, 1),
        # Fewer than train_batch / mini_batch when a short batch trains (on_max_gen_batches=continue).
        "train/mini_batches": float(len(batch.mini_batches)),
        "train/gen_acc": collected.gen_acc,
        "train/gen_score": collected.gen_score,
        "train/gen_truncated": collected.gen_truncated,
        "train/generated_tokens": float(collected.generated_tokens),
        **timer.metrics(),
        "perf/throughput": tokens / max(seconds, 1e-9) / env.world_size,
        "perf/max_memory_allocated_gb": (torch.cuda.max_memory_allocated(env.device) /
                                         2**30 if env.device.type == "cuda" else 0.0)
    }
    if not collected.groups_generated:  # split placement: a batch of groups rolled over, nothing generated
        m = {k: v for k, v in m.items() if not k.startswith(("train/gen_", "train/kept_fraction",
                                                             "train/all_equal_fraction"))}
    if not len(scores):  # no group kept: no score, length or advantage to report (never a fake 0)
        m = {
            k: v
            for k, v in m.items() if not k.startswith(("critic/", "response_length/", "prompt_length/"))
        }
    if not update.taken:  # no optimizer step: no loss, gradient norm or token statistics
        m = {k: v for k, v in m.items() if not k.startswith("actor/")}
    m["actor/skipped_steps"] = float(sum(update.nonfinite))
    return m


def router_metrics(update: UpdateResult) -> dict[str, float]:
    """A mixture-of-experts policy's routers (trainer/update.py): the load-balancing loss, the mean over the
    optimizer steps of each mini-batch's (before its coefficient); and the expert load, the top-k picks of
    each expert summed over the step's update forwards and every rank, as max / mean over a layer's experts
    (1: perfectly balanced; E / k: every token of the layer to the same k experts), per sparse layer
    (`moe/expert_load_max_over_mean/layer_<i>`, i counting sparse layers) and their mean over layers (where
    the family's routers take that loss: models/hf.py `router_loss`). {} for a dense policy. One all-reduce of
    [layers, experts] on every rank. With routing replay (models/moe/replay.py), `moe/route_agreement`: the
    share of recorded positions x sparse layers whose trainer top-k (its own choice, as without replay)
    equalled the engine's, over every rank (one more all-reduce)."""
    out = {}
    # also for routers no load-balancing loss balances (no expert_load)
    if update.route_agreement is not None:
        matched, recorded = all_reduce(torch.tensor(update.route_agreement, dtype=torch.float64)).tolist()
        if recorded > 0:
            out["moe/route_agreement"] = matched / recorded
    if update.expert_load is None:
        return out
    load = all_reduce(update.expert_load).cpu()
    if update.router_aux_losses:
        out["actor/router_aux_loss"] = sum(update.router_aux_losses) / len(update.router_aux_losses)
    if float(load.sum()) > 0:
        per_layer = load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-12)
        out["moe/expert_load_max_over_mean"] = per_layer.mean().item()
        out.update({f"moe/expert_load_max_over_mean/layer_{i}": v.item() for i, v in enumerate(per_layer)})
    return out


def split_metrics(means: dict[str, float], acc: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """The clip fractions by region, the up-clipped tokens' old probability and tail share, and length and
    entropy split by the verdict (trained responses). A mean over nothing (no up-clipped token, no correct
    response) is left out, never reported as 0."""
    out = {"actor/clipfrac_upper": means["clip_upper"], "actor/clipfrac_lower": means["clip_lower"],
           "actor/clipfrac_dual": means["clip_dual"]}
    for key, name in (("upclip_old_prob", "actor/upclip_old_prob"), ("upclip_tail",
                                                                     "actor/upclip_tail_fraction"),
                      ("entropy_correct", "actor/entropy_correct"), ("entropy_wrong", "actor/entropy_wrong")):
        if key in means:
            out[name] = means[key]
    for flags, name in ((acc, "response_length/correct_mean"), (~acc, "response_length/wrong_mean")):
        if bool(flags.any()):
            out[name] = lengths[flags].double().mean().item()
    return out


__all__ = ["router_metrics", "split_metrics", "step_metrics"]

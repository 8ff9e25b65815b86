"""Steps 5 and 7 of one training step (docs/architecture.md, "One training step"): old log-probs, and the
actor update over mini- and micro-batches.

Each mini-batch is one optimizer step. Its loss is the sum of the clipped surrogate over every valid
response token of the mini-batch, each divided by its normalizer under `algorithm.loss_agg_mode` (by
default the GLOBAL number of those tokens, all micro-batches, all ranks) and weighed by the rollout
correction. The normalizers come from every rank's token counts, gathered once before the first
micro-batch; FSDP2 sums (does not average) the gradients over ranks. So 1 rank and N ranks, and any
micro-batch split, give the same gradient.

A mixture-of-experts policy (models/moe/) adds its routers' load-balancing loss with the run's coefficient
c (`model.router_aux_loss_coef`, else the model config's): each sequence's loss (transformers'
Switch-Transformer loss over that sequence's tokens, models/moe/balance.py) divided by the GLOBAL number of
sequences in the mini-batch, so the term is c x the mean over the mini-batch's sequences, and, like the
token-level loss, the same on any number of ranks and any micro-batch split. It is logged before the
coefficient (`actor/router_aux_loss`), with the expert load of every sparse layer (`moe/`).

With routing replay (algorithm.routing_replay=r3, models/moe/replay.py) every forward here, the old log-probs'
and the update's, routes each token to the experts the rollout engine recorded for it; the share of positions
where the trainer's own choice agreed is counted over the forwards before the step's first optimizer step (the
weights the engine sampled with), `moe/route_agreement`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from ..algorithm import LossStats, on_policy, token_loss
from ..config import Config
from ..distributed.collectives import all_reduce
from ..distributed.mesh import DistEnv
from ..errors import FlashdapoError
from ..models.lora import adapter_dropout
from ..models.moe import RouterLogits, load_balancing, loss_routers, router_aux_coef, token_sequences
from ..models.moe.expert_parallel import clip_grad_norm_over_meshes
from ..models.policy import PolicyModel, per_token_split
from .batch import (
    Group,
    TrainBatch,
    flat_prompts,
    flat_responses,
    flat_routes,
    mini_batch_normalizers,
    plan_micro_batches,
)


def micro_batches(prompts: list[torch.Tensor], responses: list[torch.Tensor], budget: int, pad_id: int,
                  padded: bool):
    """(indices, prompts, responses) per micro-batch; empty micro-batches carry one masked dummy token."""
    counts = [len(p) + max(len(r) - 1, 0) for p, r in zip(prompts, responses)]
    for indices in plan_micro_batches(counts, budget, padded):
        if indices:
            yield indices, [prompts[i] for i in indices], [responses[i] for i in indices]
        else:  # keeps this rank's FSDP2 collectives in step with ranks that have work
            dummy = torch.tensor([pad_id])
            yield [], [dummy], [dummy]


def _budget(policy: PolicyModel, cfg: Config) -> int:
    """Tokens of one micro-batch: trainer.micro_batch_tokens per rank, so sp x that for a sequence-parallel
    group (each of its ranks holds 1/sp)."""
    return cfg.trainer.micro_batch_tokens * policy.sp


def old_logprobs(policy: PolicyModel, groups: list[Group], cfg: Config, pad_id: int,
                 device: torch.device) -> list[torch.Tensor] | None:
    """pi_old per response token of `groups`: None when on-policy, else by `algorithm.old_logprobs`
    (recomputed by the policy, or the rollout engine's sampling log-probs)."""
    if on_policy(cfg):
        return None
    if cfg.algorithm.old_logprobs == "recompute":
        return compute_old_logprobs(policy, groups, cfg, pad_id, device)
    if any(g.sampler_logprobs is None for g in groups):
        raise ValueError("algorithm.old_logprobs=rollout: the rollout engine returned no log-probs; "
                         "use algorithm.old_logprobs=recompute")
    return [lp.float() for g in groups for lp in g.sampler_logprobs]


@torch.no_grad()
def compute_old_logprobs(policy: PolicyModel, groups: list[Group], cfg: Config, pad_id: int,
                         device: torch.device) -> list[torch.Tensor]:
    """log pi_old(y_t) of every response token of `groups` (in order), recomputed by the policy before the
    update (fp32, CPU)."""
    all_responses = flat_responses(groups)
    routes = flat_routes(groups)
    out: list[torch.Tensor | None] = [None] * len(all_responses)
    for indices, prompts, responses in micro_batches(flat_prompts(groups), all_responses,
                                                     _budget(policy, cfg), pad_id, not policy.packed_layout):
        packed = policy.token_batch(prompts, responses, device,
                                    None if routes is None else [routes[i] for i in indices])
        logp, _ = policy(packed)
        logp = policy.whole_micro_batch(logp, packed)  # sequence parallelism: the group's shards together
        if indices:
            for i, values in zip(indices, per_token_split(logp.float().cpu(), packed)):
                out[i] = values
    # FSDP2 keeps the root unsharded after a forward (backward would need it at once); with no backward
    # here, reshard it so that parameters(), state dicts and the optimizer see the sharded tensors again.
    policy.reshard()
    return out  # type: ignore[return-value]


class NonFiniteError(FlashdapoError, RuntimeError):
    """trainer.max_skipped_steps optimizer steps in a row had a non-finite loss or gradient norm."""


@dataclass
class UpdateResult:
    """Per optimizer step taken: global pg_loss and grad norm; the token sums of those steps; and, per
    attempted optimizer step (a mini-batch with valid tokens), whether it was skipped as non-finite."""

    pg_losses: list[float]
    grad_norms: list[float]
    stats: LossStats
    nonfinite: list[bool]
    losses: list[float] = field(default_factory=list)
    """Per optimizer step taken, the loss backpropagated: pg_loss plus the routers' term (MoE)."""
    router_aux_losses: list[float] = field(default_factory=list)
    """MoE: per optimizer step taken, the routers' load-balancing loss, the mean over the mini-batch's
    sequences (before the coefficient); empty for a dense policy."""
    expert_load: torch.Tensor | None = None
    """MoE: [sparse layers, experts] top-k picks of each expert in this rank's update forwards; None:
    dense."""
    route_agreement: tuple[int, int] | None = None
    """Routing replay: (positions x sparse layers where the trainer's own top-k equalled the engine's, those
    recorded) on this rank, over the step's forwards before its first optimizer step; None: no replay."""

    @property
    def taken(self) -> int:
        """Optimizer steps that happened."""
        return len(self.pg_losses)


def update_actor(policy: PolicyModel, optimizer: torch.optim.Optimizer, batch: TrainBatch, cfg: Config,
                 env: DistEnv, pad_id: int) -> UpdateResult:
    """ppo_epochs x mini-batches optimizer steps over this rank's share of the batch. A mini-batch with no
    valid token on any rank takes no step; one whose global loss or gradient norm is NaN/inf takes none either
    (on every rank: both are global), so a non-finite value never reaches the weights or Adam's moments."""
    router = RouterTerm.of(policy, cfg, env.device)
    result = UpdateResult([], [], LossStats.zeros(), [], expert_load=None if router is None else router.load)
    with adapter_dropout(policy.hf):
        _update_epochs(policy, optimizer, batch, cfg, env, pad_id, router, result)
    if policy.route_replay is not None:
        policy.route_replay.load(None)
        result.route_agreement = policy.route_replay.take_agreement()
    return result


def _update_epochs(policy: PolicyModel, optimizer: torch.optim.Optimizer, batch: TrainBatch, cfg: Config,
                   env: DistEnv, pad_id: int, router: RouterTerm | None, result: UpdateResult) -> None:
    for _ in range(cfg.trainer.ppo_epochs):
        for groups in batch.mini_batches:
            outcome = _mini_batch_step(policy, optimizer, batch, batch.response_slices(groups), cfg, env,
                                       pad_id, router)
            if outcome is None:
                continue
            # the weights moved: the engine's routes are no longer comparable
            if policy.route_replay is not None:
                policy.route_replay.counting = False
            loss, aux, grad_norm, stats = outcome
            finite = math.isfinite(loss) and math.isfinite(aux) and math.isfinite(grad_norm)
            result.nonfinite.append(not finite)
            if finite:
                result.pg_losses.append(loss)
                result.losses.append(loss + (router.coef * aux if router is not None else 0.0))
                result.grad_norms.append(grad_norm)
                result.stats = result.stats + stats
                if router is not None:
                    result.router_aux_losses.append(aux)


@dataclass
class RouterTerm:
    """The routers' load-balancing term of a mixture-of-experts policy's update (see the module docstring)."""

    coef: float
    """Its weight in the loss (0: computed for the log, not trained on)."""
    top_k: int
    load: torch.Tensor
    """[sparse layers, experts] float64 top-k picks so far, this rank's tokens."""

    @classmethod
    def of(cls, policy: PolicyModel, cfg: Config, device: torch.device) -> RouterTerm | None:
        """The term of `policy` under `cfg`; None for a dense policy or routers no such loss balances."""
        found = loss_routers(policy.hf)
        if not found:
            return None
        return cls(router_aux_coef(cfg.model.router_aux_loss_coef, policy.config), int(found[0].top_k),
                   torch.zeros(len(found), int(found[0].num_experts), dtype=torch.float64, device=device))

    def micro_batch(self, policy: PolicyModel, routing: RouterLogits, packed, num_sequences: int,
                    sequences: torch.Tensor) -> torch.Tensor:
        """This rank's share of the mini-batch's term from one forward's router logits (`routing`) over its
        `num_sequences` sequences, divided by the mini-batch's global sequence count `sequences`; adds the
        forward's picks to `load`. Differentiable only when the coefficient is on."""
        with torch.set_grad_enabled(self.coef > 0 and torch.is_grad_enabled()):
            ids = token_sequences(num_sequences, packed.bounds, packed.attention_mask, policy.sp,
                                  policy.sp_rank)
            balance = load_balancing(routing.layers, ids, num_sequences, self.top_k,
                                     policy.sp_group if policy.sp > 1 else None, routing.chosen)
            self.load += balance.load
            return balance.loss_sum / sequences


def _mini_batch_step(policy, optimizer, batch: TrainBatch, rows: slice, cfg: Config, env: DistEnv,
                     pad_id: int, router: RouterTerm | None = None):
    prompts, responses = batch.prompts[rows], batch.responses[rows]
    routes = None if batch.routes is None else batch.routes[rows]
    old = None if batch.old_logprobs is None else batch.old_logprobs[rows]
    advantages = batch.advantages[rows]
    correct = batch.acc[rows]
    loss_mask = batch.loss_mask[rows]
    weights = batch.rollout_weights[rows]
    # A token masked by the rollout correction (weight 0) leaves the loss and its normalizer.
    token_mask = [(w > 0) & bool(m) for w, m in zip(weights, loss_mask.tolist())]
    normalizers, num_tokens = mini_batch_normalizers(torch.tensor([int(m.sum()) for m in token_mask]),
                                                     cfg.algorithm, env.sequence_parallel,
                                                     batch.response_keys[rows])
    if num_tokens == 0:
        # No valid token on any rank (all ranks agree: the count is global). An optimizer step on zero
        # gradients would still move the weights (Adam momentum, weight decay): skip it.
        return None
    optimizer.zero_grad(set_to_none=True)
    # the mini-batch's sequences over all ranks (a sequence-parallel group's count once)
    if router is not None:
        sequences = all_reduce(torch.tensor([float(len(prompts))], dtype=torch.float64, device=env.device))
        sequences = sequences.to(env.device) / env.sequence_parallel
    # [pg loss, router loss, *stats] summed on the device: no host sync per micro-batch, one all-reduce per
    # mini-batch.
    totals = torch.zeros(2 + len(fields(LossStats)), dtype=torch.float64, device=env.device)
    for indices, mb_prompts, mb_responses in micro_batches(prompts, responses, _budget(policy, cfg), pad_id,
                                                            not policy.packed_layout):
        packed = policy.token_batch(mb_prompts, mb_responses, env.device,
                                    None if routes is None else [routes[i] for i in indices])
        # MoE: the forward puts its router logits here
        routing = RouterLogits() if router is not None else None
        if indices:  # per response token of the micro-batch; under sequence parallelism this rank's shard
            per_token = [(advantages[i].expand(len(responses[i])), token_mask[i], weights[i],
                          normalizers[i].expand(len(responses[i])), correct[i].expand(len(responses[i])))
                         for i in indices]
            adv_t, mask_t, weight_t, norm_t, correct_t = (packed.local(torch.cat(parts)).to(env.device)
                                                          for parts in zip(*per_token))
            old_t = None if old is None else packed.local(torch.cat([old[i] for i in indices])).to(env.device)
        else:
            old_t = None
            adv_t, weight_t, norm_t = (packed.local(torch.zeros(1, device=env.device)) for _ in range(3))
            mask_t, correct_t = (packed.local(torch.zeros(1, dtype=torch.bool, device=env.device))
                                 for _ in range(2))
        if indices and policy.fused_loss(env.device):  # log-probs and the loss gradient in one sweep
            def loss_fn(lp, r, old_t=old_t, adv_t=adv_t, mask_t=mask_t, weight_t=weight_t, norm_t=norm_t):
                return token_loss(lp, None if old_t is None else old_t[r], adv_t[r].float(), mask_t[r],
                                  cfg.algorithm, normalizer=norm_t[r], weights=weight_t[r])[0]

            loss, logp, entropy = policy(packed, loss_fn=loss_fn, keep=mask_t, routing=routing)
            with torch.no_grad():
                _, micro_stats = token_loss(logp, old_t, adv_t.float(), mask_t, cfg.algorithm,
                                            normalizer=norm_t, weights=weight_t, entropy=entropy,
                                            correct=correct_t)
        else:
            logp, entropy = policy(packed, with_entropy=True, keep=mask_t if indices else None,
                                   routing=routing)
            loss, micro_stats = token_loss(logp, old_t, adv_t.float(), mask_t, cfg.algorithm,
                                           normalizer=norm_t, weights=weight_t, entropy=entropy.detach(),
                                           correct=correct_t)
        aux = torch.zeros((), dtype=torch.float64, device=env.device)
        if router is not None:
            aux = router.micro_batch(policy, routing, packed, len(indices), sequences)
        (loss + router.coef * aux if router is not None and router.coef > 0 else loss).backward()
        totals += torch.cat([loss.detach().double().reshape(1), aux.detach().double().reshape(1),
                             micro_stats.as_vector()])
    totals = all_reduce(totals).cpu()
    grad_norm = _clip_grad_norm(policy, cfg.optim.grad_clip)
    # global values: every rank agrees
    if math.isfinite(grad_norm) and math.isfinite(totals[:2].sum().item()):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # free the gradients now, not at the next mini-batch
    return totals[0].item(), totals[1].item(), grad_norm, LossStats.from_vector(totals[2:])


def _clip_grad_norm(policy: PolicyModel, max_norm: float) -> float:
    """Global gradient norm over the sharded parameters (DTensor-aware, expert-parallel meshes too), clipped
    when max_norm > 0."""
    return clip_grad_norm_over_meshes([p for p in policy.parameters() if p.grad is not None], max_norm)

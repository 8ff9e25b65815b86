"""The policy: an HF causal LM run to its final hidden states, with per-token log-probs and entropies
taken through `flashdapo.kernels` from the LM-head weight (never through the model's `[tokens, vocab]`
logits). The loss is composed on those log-probs by the update (`flashdapo.algorithm.token_loss`).

`PolicyModel` is the FSDP2 root. All training computation happens inside its `forward`, so FSDP2's
hooks gather the root-level parameters (embeddings, final norm, LM head) around it and reduce their
gradients after backward. Called with HF keyword arguments instead (`input_ids=..., past_key_values=...`)
it is the plain HF model, which is how the rollout engine samples from it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed.mesh import DistEnv
from ..kernels import fused_token_loss, token_logprobs, token_probe_stats
from ..kernels.invariant import row_tiled_matmul
from ..kernels.lm_head_choice import use_fused_loss
from ..profiling.ranges import traced
from .hf import cache_argument, decoder_layers, final_logit_softcap
from .linear_attention import check_sequence_parallel
from .moe.replay import RouteReplay, install_route_replay, lay_out_routes
from .moe.router import RouterLogits, router_logits_kwargs
from .packing import DocumentBounds, packed_attention_kwargs, use_packed_attention
from .ulysses import check_layer_heads, gather_token_values, layer_heads, local_predictions, shard_bounds


@dataclass
class TokenBatch:
    """One micro-batch of (prompt + response) sequences, laid out for the attention backend.

    packed: one row [1, T], positions restarting per sequence, no padding; attention stays inside each
    sequence (`packing.py`). padded: rows [B, L] right-padded, with a 2-D attention mask.
    Under sequence parallelism (sp ranks) the packed row is padded to a multiple of sp and this rank holds
    its contiguous 1/sp of it: `input_ids`, `position_ids`, `predict_index` and `targets` are the local
    shard's, `held` says which of the micro-batch's response tokens those are, `bounds` are the row's.
    """

    input_ids: torch.Tensor
    """[1, T] packed (T / sp under sequence parallelism) or [B, L] padded token ids."""
    position_ids: torch.Tensor
    """Same shape: positions restarting at 0 for every sequence."""
    attention_mask: torch.Tensor | None
    """[B, L] 1 for real tokens (padded layout); None when packed."""
    predict_index: torch.Tensor
    """[N] flat indices (into input_ids.view(-1)) of the positions whose hidden state predicts a response
    token."""
    targets: torch.Tensor
    """[N] the response tokens predicted at `predict_index`."""
    token_counts: list[int]
    """Response tokens of each sequence, in order (to split per-token outputs back)."""
    bounds: DocumentBounds | None = None
    """Sequence boundaries of the whole packed row (host and device copies, made here once); None when
    padded."""
    held: torch.Tensor | None = None
    """Sequence parallelism: indices, into the micro-batch's response tokens, of the N this rank predicts
    (None: all of them)."""
    routes: torch.Tensor | None = None
    """Routing replay: the engine's experts of every position of `input_ids` (flattened; this rank's shard),
    [positions, sparse layers, top_k], -1 where none (models/moe/replay.py); None: the routers choose."""

    @property
    def total_tokens(self) -> int:
        """Response tokens of the whole micro-batch (all shards)."""
        return sum(self.token_counts)

    def local(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's entries of a per-response-token vector of the whole micro-batch."""
        return values if self.held is None else values[self.held.to(values.device)]


def make_token_batch(prompts: list[torch.Tensor], responses: list[torch.Tensor], device: torch.device,
                     packed: bool, sp: int = 1, sp_rank: int = 0,
                     routes: list[torch.Tensor | None] | None = None) -> TokenBatch:
    """Lay out (prompt, response) pairs for one forward; the last response token is never an input.

    The hidden state at position p predicts token p + 1, so response token j of a sequence is predicted at
    position len(prompt) - 1 + j of that sequence. With sp > 1 (packed only) the row gets a filler
    sequence up to a multiple of sp, and this is rank `sp_rank`'s shard of it. `routes`: each sequence's
    recorded experts (routing replay), laid out the same way.
    """
    rows = [torch.cat([p, r[:-1]]) if len(r) else p for p, r in zip(prompts, responses)]
    if packed and sum(len(t) for t in rows) % sp:  # the filler's outputs predict nothing
        rows.append(torch.zeros(sp - sum(len(t) for t in rows) % sp, dtype=torch.long))
    width = sum(len(t) for t in rows) if packed else max(len(t) for t in rows)
    starts = list(itertools.accumulate([len(t) for t in rows[:-1]], initial=0)) if packed else \
        [i * width for i in range(len(rows))]
    predict = torch.cat([start + len(p) - 1 + torch.arange(len(r))
                         for start, p, r in zip(starts, prompts, responses)]).long()
    targets = torch.cat(list(responses)).long()
    bounds = held = None
    shard = shard_bounds(width, sp, sp_rank) if packed and sp > 1 else None
    laid_out = None if routes is None else lay_out_routes(routes, [len(t)
                                                                   for t in rows], packed, width, shard)
    if packed:
        input_ids = torch.cat(rows).unsqueeze(0)
        positions = torch.cat([torch.arange(len(t)) for t in rows]).unsqueeze(0)
        mask = None
        bounds = DocumentBounds.from_lengths([len(t) for t in rows], device)
        if sp > 1:
            start, end = shard_bounds(width, sp, sp_rank)
            held, predict = local_predictions(predict, start, end)
            input_ids, positions, targets = input_ids[:, start:end], positions[:, start:end], targets[held]
    else:
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, t in enumerate(rows):
            input_ids[i, :len(t)] = t
            mask[i, :len(t)] = 1
        positions = torch.arange(width).expand(len(rows), width)
    return TokenBatch(
        input_ids=input_ids.long().to(device),
        position_ids=positions.to(device),
        attention_mask=None if mask is None else mask.to(device),
        predict_index=predict.to(device),
        targets=targets.to(device),
        token_counts=[len(r) for r in responses],
        bounds=bounds,
        held=held,
        routes=None if laid_out is None else laid_out.to(device),
    )


class PolicyModel(nn.Module):
    """The HF causal LM plus the fused log-prob head. The FSDP2 root."""

    def __init__(self, hf_model: nn.Module, attn_implementation: str, kernel_impl: str, temperature: float):
        super().__init__()
        self.hf = hf_model
        self.attn_implementation = attn_implementation
        self.kernel_impl = kernel_impl
        self.temperature = temperature
        self._cache_arg = cache_argument(hf_model)
        self.softcap = final_logit_softcap(hf_model.config)
        """The model's final-logit softcap (Gemma 2/3/4), applied inside the LM-head kernels; None: none."""
        self.pack = attn_implementation == "flash_attention_2"
        """Packed micro-batches (`set_layout`); until then only flash-attn packs (the toy warm-up pads)."""
        self.sp_group = None
        self.sp, self.sp_rank = 1, 0
        self.micro_batch_tokens = 16384
        """Tokens of a micro-batch on this rank (set by `parallelize`): the LM-head design is chosen for
        it."""
        self._fused: dict[str, bool] = {}
        self.invariant = False
        """trainer.batch_invariant (models/invariant.py): the LM-head kernels with invariant=True, and the
        torch engine's sampled log-probs from them (`sampled_logprobs`)."""
        self.route_replay: RouteReplay | None = None
        """Routing replay (algorithm.routing_replay=r3): replays a TokenBatch's routes in its forward."""

    def with_route_replay(self, mode: str) -> PolicyModel:
        """This policy, replaying recorded routes in its training forwards when `mode`
        (algorithm.routing_replay) is r3; ConfigError for r3 on a dense model."""
        self.route_replay = install_route_replay(self.hf, mode)
        return self

    @property
    def config(self):
        return self.hf.config

    def decoder_layers(self) -> nn.ModuleList:
        return decoder_layers(self.hf)

    def lm_head_weight(self) -> torch.Tensor:
        return self.hf.get_output_embeddings().weight

    def forward(self, batch: TokenBatch | None = None, with_entropy: bool = False, cache=None, loss_fn=None,
                keep: torch.Tensor | None = None, probe: bool = False, routing: RouterLogits | None = None,
                hidden_only: bool = False, **hf_kwargs):
        """Training: per-token (logp, entropy or None) of `batch`, fp32, differentiable in the weights. With
        `keep` (the loss mask), rows outside it get no LM-head work and 0 for logp and entropy; with
        `loss_fn` too (a per-token loss, see kernels.fused_token_loss), (loss, logp, entropy) from the
        fused sweep, logp and entropy detached. With `probe`: no-grad (logp, entropy, top-1 probability)
        (kernels.token_probe_stats), for the probe (probe.py). With `routing` (MoE families), the router
        logits of the forward are put in it, one [tokens, E] tensor per sparse layer (models/moe/).
        Sampling: with HF keyword arguments and no batch, the HF model's own forward (`cache` is the KV
        cache, passed under the name this transformers version uses); `hidden_only`: its decoder's last
        hidden states [B, T, H] instead (the batch-invariant engine projects them itself)."""
        if batch is None:
            if self.route_replay is not None:  # sampling routes for itself
                self.route_replay.load(None)
            if cache is not None:
                hf_kwargs[self._cache_arg] = cache
            if hidden_only:
                hf_kwargs.pop("logits_to_keep", None)
                return self.hf.model(**hf_kwargs).last_hidden_state
            return self.hf(**hf_kwargs)
        hidden = self._hidden_states(batch, routing)
        if probe and batch.held is not None and not len(batch.targets):  # no backward: nothing to tie
            empty = torch.zeros(0, dtype=torch.float32, device=hidden.device)
            return empty, empty, empty
        if probe:
            return token_probe_stats(hidden, self.lm_head_weight(), batch.targets,
                                     temperature=self.temperature, impl=self.kernel_impl,
                                     softcap=self.softcap)
        if batch.held is not None and not len(batch.targets):
            return self._nothing_held(hidden, with_entropy or keep is not None, loss_fn is not None)
        # One named range per LM-head call, forward and backward, in profiled steps (flashdapo/profiling).
        return traced("lm_head", self._lm_head, (hidden, self.lm_head_weight()), batch, with_entropy, loss_fn,
                      keep)

    def _lm_head(self, hidden: torch.Tensor, weight: torch.Tensor, batch: TokenBatch, with_entropy: bool,
                 loss_fn, keep: torch.Tensor | None):
        """The LM-head kernels on the predicting hidden states: see `forward`."""
        if loss_fn is not None:
            return fused_token_loss(hidden, weight, batch.targets, loss_fn, keep=keep,
                                    temperature=self.temperature, impl=self.kernel_impl, softcap=self.softcap,
                                    invariant=self.invariant)
        if keep is not None:  # rows outside the loss mask cost no LM-head work; their outputs are 0
            rows = torch.nonzero(keep).squeeze(1)
            logp, entropy = token_logprobs(hidden[rows], weight, batch.targets[rows],
                                           temperature=self.temperature, with_entropy=True,
                                           impl=self.kernel_impl, softcap=self.softcap,
                                           invariant=self.invariant)
            zeros = logp.new_zeros(keep.shape)
            return zeros.index_put((rows,), logp), zeros.index_put((rows,), entropy)
        out = token_logprobs(hidden, weight, batch.targets, temperature=self.temperature,
                             with_entropy=with_entropy, impl=self.kernel_impl, softcap=self.softcap,
                             invariant=self.invariant)
        return out if with_entropy else (out, None)

    @torch.no_grad()
    def sampling_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] fp32 of last hidden states [B, H] for the batch-invariant engine to draw from (each
        row in whole GEMM tiles; the model's final-logit softcap applied)."""
        weight = self.lm_head_weight()
        logits = row_tiled_matmul(hidden.float(), weight.float().t())
        return logits if self.softcap is None else self.softcap * torch.tanh(logits / self.softcap)

    @torch.no_grad()
    def sampled_logprobs(self, hidden: torch.Tensor, tokens: torch.Tensor,
                         temperature: float) -> torch.Tensor:
        """log p(token) [B] fp32 of the drawn tokens from the LM-head kernel with invariant=True: the bits the
        old-log-prob pass and the update's sweep give the same token (trainer.batch_invariant)."""
        return token_logprobs(hidden, self.lm_head_weight(), tokens, temperature=temperature,
                              impl=self.kernel_impl, softcap=self.softcap, invariant=True)

    def fused_loss(self, device: torch.device) -> bool:
        """Whether the update should pass its loss to forward (the fused sweep) on `device`: the kernel cost
        model's choice for this GPU (kernels/lm_head_choice.py), the fused sweep on a CPU."""
        if str(device) not in self._fused:
            vocab, hidden = self.lm_head_weight().shape
            self._fused[str(device)] = use_fused_loss(self.kernel_impl, device, self.micro_batch_tokens,
                                                      hidden, vocab, softcap=self.softcap is not None)
        return self._fused[str(device)]

    @property
    def packed_layout(self) -> bool:
        """Micro-batches as packed rows (attention per sequence), else right-padded rows."""
        return self.pack

    def set_layout(self, pack: bool, env: DistEnv) -> None:
        """Pack micro-batches (or pad them), split over env's sequence-parallel group when it has one."""
        if env.sequence_parallel > 1:
            check_sequence_parallel(self.config, env.sequence_parallel)
            check_layer_heads(layer_heads(self.config), env.sequence_parallel)
        self.pack = pack or env.sequence_parallel > 1
        self.sp_group, self.sp, self.sp_rank = env.sp_group, env.sequence_parallel, env.sp_rank
        if self.pack:
            use_packed_attention(self.hf)

    def token_batch(self, prompts: list[torch.Tensor], responses: list[torch.Tensor], device,
                    routes: list[torch.Tensor | None] | None = None) -> TokenBatch:
        """A micro-batch laid out for this policy's attention backend (this rank's shard of it under SP), with
        the responses' recorded `routes` when this policy replays them."""
        return make_token_batch(prompts, responses, device, self.packed_layout, self.sp, self.sp_rank,
                                routes if self.route_replay is not None else None)

    def whole_micro_batch(self, values: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
        """A per-token output of `batch` for all its response tokens: under sequence parallelism the group's
        shards put together ([N] values, never hidden states); else `values` itself."""
        if batch.held is None:
            return values
        return gather_token_values(values, batch.held.to(values.device), batch.total_tokens, self.sp_group)

    def _hidden_states(self, batch: TokenBatch, routing: RouterLogits | None = None) -> torch.Tensor:
        # MoE: record the router logits only when asked, whatever config.json's output_router_logits says.
        moe = router_logits_kwargs(self.config, record=routing is not None)
        # kept loaded until the next forward: a checkpointed block's recompute
        if self.route_replay is not None:
            self.route_replay.load(batch.routes)
        if batch.bounds is not None:
            packed = packed_attention_kwargs(self.hf, batch.bounds, self.sp_group)
            out = self.hf.model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                                **packed, **moe)
        else:
            out = self.hf.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                attention_mask=batch.attention_mask, use_cache=False, **moe)
        if routing is not None:
            routing.layers = tuple(getattr(out, "router_logits", None) or ())
            routing.chosen = self.route_replay.chosen_layers() if self.route_replay is not None else None
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
        if batch.held is not None and not len(batch.predict_index):
            return hidden  # the whole shard: see _nothing_held
        return hidden.index_select(0, batch.predict_index)

    def _nothing_held(self, hidden: torch.Tensor, with_entropy: bool, with_loss: bool):
        """Outputs of a sequence-parallel rank whose shard predicts no response token (all prompt, or
        filler): empty, but tied with a zero weight to the shard's hidden states and the LM head, so that
        backward still runs the group's all-to-alls and FSDP2's reductions on this rank."""
        anchor = (hidden.sum() + self.lm_head_weight().sum()) * 0.0
        empty = anchor.new_zeros(0)
        if with_loss:
            return anchor, empty, empty
        return empty + anchor, (empty if with_entropy else None)


def per_token_split(values: torch.Tensor, batch: TokenBatch) -> list[torch.Tensor]:
    """Split a per-response-token vector of `batch` back into one tensor per sequence."""
    return list(torch.split(values, batch.token_counts))


__all__ = ["PolicyModel", "TokenBatch", "make_token_batch", "per_token_split"]

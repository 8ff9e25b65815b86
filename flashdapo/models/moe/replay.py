"""Rollout routing replay (R3, `algorithm.routing_replay=r3`): the trainer's forwards route every token to the
experts the rollout engine routed it to, and recompute only the gate weights from their own router logits.

The choices, before the code:

- **What is recorded.** Per response, the engine's top-k expert indices at every position the trainer feeds:
  the prompt and the response but its last token (whose output predicts nothing), an int tensor
  [prompt + response - 1, layers, top_k] (one row per sparse layer from the torch engine, one per decoder
  layer, dense ones included, from vLLM's routed_experts: `RouteReplay.load` takes either) (`route_dtype`:
  uint8 up to 256 experts). Prompt positions are replayed too: a response token's log-prob depends on every
  earlier position's hidden state through attention, so replaying only the response positions would leave the
  prompt's routes, and through them the response's, free to differ. vLLM returns exactly those positions
  (`CompletionOutput.routed_experts`, prompt included); the torch engine records them with a forward hook on
  each router (rollout/torch_engine.py). A position the engine computed more than once (the torch stream
  re-prefills running rows; a carried partial rollout is prefilled again under newer weights) holds its last
  routing, the one later tokens' keys and values came from.
- **What is replayed.** Each router's forward still runs: its logits (and so the load-balancing loss) are the
  trainer's own. A forward hook then replaces its outputs for the positions that have a record: the indices
  are the recorded ones and the weights are transformers' Qwen3-MoE math on them (softmax of the router logits
  in fp32, gathered at those indices, renormalised when `norm_topk_prob`, cast back), so the gradient reaches
  the router through the weights. Positions without a record (padding, sequence-parallel filler, a response
  without a record) keep the router's own choice.
- **Layout.** The records are laid out like the micro-batch's tokens (`lay_out_routes`): one packed row, or
  right-padded rows flattened, then this rank's shard under sequence parallelism, the row order of the
  router's input (`hidden.view(-1, H)`).
- **Lifetime.** A layout stays loaded until the next training forward loads another (None: none), so that an
  activation-checkpointed block recomputed during backward replays the same routes; a forward through the HF
  model's own keywords (sampling) unloads it (models/policy.py).
- **Agreement.** While `counting`, each router's own top-k (before replay, what the trainer would route with
  R3 off) is compared with the record at every recorded position: `matched` / `recorded` positions x layers
  whose expert sets are equal (`moe/route_agreement`).

The routers are the softmax top-k routers of the registry's MoE families (Qwen3-MoE, Qwen3-Next: their forward
returns (logits, top-k weights, top-k indices)).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...errors import ConfigError
from ..hf import decoder_layers
from .router import family_entry, loss_routers, routers

NO_ROUTE = -1
"""A position of a laid-out micro-batch without a record: its router chooses for itself."""


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype a record of `num_experts` experts fits in."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int32


def replay_weights(router_logits: torch.Tensor, indices: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """[tokens, k] gate weights of the experts `indices` [tokens, k] from `router_logits` [tokens, E], as
    transformers' Qwen3-MoE router computes them for its own top-k: softmax in fp32, gathered, renormalised
    over the k when `norm_topk_prob`, cast to the logits' dtype. Differentiable in the logits."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, indices.long())
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


def lay_out_routes(records: Sequence[torch.Tensor | None], row_lengths: Sequence[int], packed: bool,
                   width: int, shard: tuple[int, int] | None = None) -> torch.Tensor | None:
    """The records of one micro-batch laid out like its tokens: [positions, layers, k] int64, NO_ROUTE where a
    position has none. `records[i]` covers row i's first positions ([<= row_lengths[i], layers, k]; a longer
    one is cut, a shorter one leaves the rest unrecorded; None: no record); `row_lengths` are the rows as fed
    (prompt + response - 1, the sequence-parallel filler last); packed: one row, else `width`-wide padded
    rows; `shard`: this rank's [start, end) of the packed row. None when no row has a record."""
    first = next((r for r in records if r is not None), None)
    if first is None:
        return None
    layers, k = first.shape[1:]
    rows = []
    for i, length in enumerate(row_lengths):
        row = torch.full((length if packed else width, layers, k), NO_ROUTE, dtype=torch.long)
        record = records[i] if i < len(records) else None
        if record is not None:
            if tuple(record.shape[1:]) != (layers, k):
                raise ValueError(f"routing replay: response {i}'s record is {tuple(record.shape)}, expected "
                                 f"[positions, {layers}, {k}] like the others")
            used = min(len(record), length)
            row[:used] = record[:used].long()
        rows.append(row)
    out = torch.cat(rows)
    if shard is not None:
        out = out[shard[0]:shard[1]]
    return out


class RouteReplay:
    """Replays laid-out routes through the routers of one HF MoE model (see the module docstring).

    `sparse_layers`: each router's decoder-layer index, and `decoder_layers` the model's count of them, so
    that records with a row per decoder layer (vLLM's routed_experts: dense layers included, e.g. Qwen3-MoE's
    mlp_only_layers, DeepSeek-V3's first_k_dense_replace) load as well as records with one per sparse layer
    (the torch engine's, vLLM's captured ones); None: the routers are the decoder layers, in order."""

    def __init__(self, model_routers: list[nn.Module], sparse_layers: Sequence[int] | None = None,
                 decoder_layers: int | None = None):
        if not model_routers:
            raise ValueError("routing replay needs a mixture-of-experts model (no router found)")
        if sparse_layers is not None and len(sparse_layers) != len(model_routers):
            raise ValueError(
                f"routing replay: {len(sparse_layers)} sparse-layer indices for {len(model_routers)} "
                "routers")
        self.routers = model_routers
        self.sparse_layers = list(range(len(model_routers)) if sparse_layers is None else sparse_layers)
        self.decoder_layers = len(model_routers) if decoder_layers is None else decoder_layers
        self.layout: torch.Tensor | None = None
        self.chosen: dict[int, torch.Tensor] = {}
        """Per sparse layer, the experts the last forward's router handed on ([tokens, k], recorded where
        there was a record): what the load-balancing loss counts under replay (balance.py)."""
        self.counting = True
        self.matched = 0
        self.recorded = 0
        self._counted: set[int] = set()
        self._handles = [router.register_forward_hook(self._hook_for(layer))
                         for layer, router in enumerate(model_routers)]

    def load(self, layout: torch.Tensor | None) -> None:
        """Replay `layout` ([positions, layers, k], `lay_out_routes`) in the next forwards; None: route
        freely. Its layers: one per sparse layer, or one per decoder layer (the sparse layers' rows are
        replayed)."""
        if layout is not None and layout.shape[1] != len(self.routers):
            if layout.shape[1] != self.decoder_layers:
                raise ValueError(f"routing replay: the records hold {layout.shape[1]} layers, the model has "
                                 f"{len(self.routers)} sparse layers of {self.decoder_layers} decoder layers")
            layout = layout[:, self.sparse_layers]
        self.layout = layout
        self.chosen = {}
        self._counted = set()

    def chosen_layers(self) -> tuple[torch.Tensor, ...] | None:
        """The experts each sparse layer's router handed on in the last forward with routes loaded, in layer
        order; None without a loaded layout (the routers chose freely)."""
        if self.layout is None or len(self.chosen) != len(self.routers):
            return None
        return tuple(self.chosen[layer] for layer in range(len(self.routers)))

    def take_agreement(self) -> tuple[int, int]:
        """(matched, recorded) positions x layers counted since the last call; the counts restart and counting
        resumes."""
        out = (int(self.matched), int(self.recorded))
        self.matched = self.recorded = 0
        self.counting = True
        return out

    def remove(self) -> None:
        """Take the hooks off the routers."""
        for handle in self._handles:
            handle.remove()

    def _hook_for(self, layer: int):
        def hook(module: nn.Module, _inputs, output):
            return self._replay(layer, module, output)
        return hook

    def _replay(self, layer: int, module: nn.Module, output):
        if self.layout is None:
            return None
        logits, _, own = output
        recorded = self.layout[:, layer].to(own.device)
        if recorded.shape[0] != logits.shape[0]:
            raise RuntimeError(
                f"routing replay: the loaded routes cover {recorded.shape[0]} positions, the router "
                f"of sparse layer {layer} sees {logits.shape[0]}")
        has = recorded[:, 0] >= 0
        # once per load (not again in a checkpoint's recompute)
        if self.counting and layer not in self._counted:
            self._counted.add(layer)
            with torch.no_grad():
                same = (own.sort(dim=-1).values == recorded.sort(dim=-1).values.to(
                    own.dtype)).all(dim=-1) & has
                # Device counts, read once per step (take_agreement): no host sync per layer on a GPU.
                self.matched = self.matched + same.sum()
                self.recorded = self.recorded + has.sum()
        indices = torch.where(has[:, None], recorded.to(own.dtype), own)
        self.chosen[layer] = indices.detach()
        return logits, replay_weights(logits, indices, bool(getattr(module, "norm_topk_prob", True))), indices


def check_routing_replay(mode: str, config) -> None:
    """ConfigError in one line for `algorithm.routing_replay` r3 on a config (object or config.json dict) of a
    dense family or one without softmax top-k routers (DeepSeek-V3), before anything is built
    (preflight.check_model_settings); install_route_replay checks the built model the same way."""
    family = family_entry(config)
    if mode == "off" or family is None:
        return
    if family.routers is None:
        raise ConfigError(
            f"algorithm.routing_replay={mode}: the model ({family.model_type}) is dense (no registered "
            "mixture-of-experts router to replay); use off")
    if not family.router_loss:
        raise ConfigError(
            f"algorithm.routing_replay={mode}: the routers of {family.model_type} are not softmax top-k "
            "routers, whose gate weights the replay recomputes; use off")


def install_route_replay(hf_model: nn.Module, mode: str) -> RouteReplay | None:
    """The replay of `algorithm.routing_replay` `mode` on `hf_model`'s routers: None for "off"; ConfigError in
    one line for "r3" on a dense model."""
    if mode == "off":
        return None
    model_type = getattr(getattr(hf_model, "config", None), "model_type", "?")
    if not routers(hf_model):
        raise ConfigError(
            f"algorithm.routing_replay={mode}: the model ({model_type}) is dense (no registered "
            "mixture-of-experts router to replay); use off")
    found = loss_routers(hf_model)
    if not found:
        raise ConfigError(
            f"algorithm.routing_replay={mode}: the routers of {model_type} are not softmax top-k "
            "routers, whose gate weights the replay recomputes; use off")
    layers = decoder_layers(hf_model)
    index = {id(module): i for i, layer in enumerate(layers) for module in layer.modules()}
    return RouteReplay(found, [index[id(router)] for router in found], len(layers))


def engine_routes(captured: Sequence[torch.Tensor], batch: int, width: int, num_experts: int) -> torch.Tensor:
    """One forward's routes, as the torch engine's router hooks captured them (one [batch * width, k] top-k
    index tensor per sparse layer), as [batch, width, layers, k] in `route_dtype`."""
    stacked = torch.stack([c.reshape(batch, width, -1) for c in captured], dim=2)
    return stacked.to(route_dtype(num_experts))


__all__ = [
    "NO_ROUTE", "RouteReplay", "engine_routes", "install_route_replay", "lay_out_routes", "replay_weights",
    "route_dtype"
]

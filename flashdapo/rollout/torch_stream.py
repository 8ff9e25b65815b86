"""Continuous batching for the torch engine: requests join and leave the decode batch of a static KV cache.

The choices, before the code:

- **Packs.** The running requests form one left-padded batch over one `StaticCache` (a *pack*), decoded
  one token per `step()` exactly as `TorchEngine` always decoded (prefill, then one token per row per
  forward; finished rows are fed pads until the pack is rebuilt). When queued requests wait and the pack has
  room (policy `fill`: at least half of its rows finished, or none running; policy `drain`: only once
  every row finished, the sequential sub-batches of `generate`), the pack is rebuilt: the running rows'
  whole context (prompt + carried prefix + what they sampled so far) and the next queued requests, up to
  `max_batch` rows, are prefilled into a fresh cache, and that prefill's logits give every row its next
  token. Re-prefilling costs one forward over the running rows' context (compute-bound, one call) instead
  of keeping a cache with per-row slots; a request's tokens never depend on when it joined, except through
  the shared random stream and floating-point batch effects.
- **Why half.** Every rebuild re-prefills all running rows to add the queued ones, and finished rows only
  cost pad decoding until then. On the long-tail workload (bench/bench_longtail.py: 48 groups of 8 in
  flight, CPU) waiting for half instead of a quarter cut the rebuilds' prefill tokens by ~40% and the
  stream's CPU time by 25-40%, with as many decode steps (within 4%) to the same number of finished groups.
- **A short cache.** Attention reads every slot of a static cache, filled or not, at every step. A `fill`
  pack's cache therefore holds its context and at most max(PACK_HORIZON, context width) more tokens, not
  every row's whole budget; a pack whose rows outlive it is rebuilt (the same rebuild, nothing queued
  needed). The cache is then at most twice what it holds, and a long response's re-prefills add up to
  about one prefill of its final length (its context at least doubles between two). On the long-tail
  workload packs are rebuilt within 32 steps anyway: same tokens, 20-35% less CPU time than a cache of
  the whole budget (192). `drain` packs (`generate`) keep the whole budget.
- **One forward per step on every rank**: a prefill, a decode, or (with nothing to run) a one-token dummy
  forward, so that FSDP2's collectives stay in step across ranks whose work differs.
- **Randomness.** One `torch.Generator` per stream, seeded like `generate` (`derive_seed(seed, rank)`):
  what a step returns is a function of the submissions, their order and the seed, never of the clock.
- **Carried prefixes** (`Request.prefix`) are prefilled after the prompt and never re-sampled; a request's
  `max_new_tokens` counts only what it may still sample.
- **Routes** (given `routes`, the engine's last forward's experts): kept per cache slot of the pack; a
  completion carries those of every position its row fed (prompt, prefix and tokens but the last), the
  rebuild's re-prefill overwriting earlier ones (models/moe/replay.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import StaticCache

from .base import Completion, Request, SamplingParams

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StaticCache], torch.Tensor]
"""(input_ids, attention_mask, position_ids, cache) -> next-token logits [B, V] fp32."""
Routes = Callable[[int, int], torch.Tensor]
"""(batch, width) -> the last forward's routes [batch, width, sparse layers, top_k]."""
Sampler = Callable[[torch.Tensor, float, float, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
REFILL_FINISHED_FRACTION = 0.5
"""Policy `fill`: queued requests join once this fraction of the pack's rows finished (module docstring)."""
PACK_HORIZON = 64
"""Policy `fill`: a pack's cache holds at most max(PACK_HORIZON, context width) tokens past its context."""


@dataclass
class _Running:
    """A request in the decode batch: what it sampled in earlier packs of this stream."""

    request: Request
    tokens: torch.Tensor
    logprobs: torch.Tensor

    @property
    def context(self) -> list[int]:
        return [*self.request.prompt, *self.request.prefix, *self.tokens.tolist()]

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.tokens)


class _Pack:
    """One left-padded batch over one static cache, decoded a token per step (TorchEngine's layout)."""

    def __init__(self, rows: list[_Running], pad_id: int, device: torch.device, config,
                 left_pad: Callable, horizon: int | None) -> None:
        self.rows = rows
        ids, mask, positions = left_pad([r.context for r in rows], pad_id, device)
        batch, self.width = ids.shape
        self.budget = torch.tensor([r.remaining for r in rows], device=device)
        steps = int(self.budget.max())
        if horizon is not None:
            steps = min(steps, max(horizon, self.width))
        self.cache = StaticCache(config=config, max_cache_len=self.width + steps)
        self.ids, self.positions = ids, positions
        # Generated tokens always occupy valid slots; only the contexts' left pads are masked.
        self.mask = torch.cat([mask, mask.new_ones(batch, steps)], dim=1)
        self.next_position = positions[:, -1] + 1
        self.tokens = torch.full((batch, steps), pad_id, dtype=torch.long, device=device)
        self.logps = torch.zeros((batch, steps), dtype=torch.float32, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.returned = [False] * batch
        self.t = 0
        self.routes: torch.Tensor | None = None
        """[batch, slots, sparse layers, top_k]: the experts each slot was routed to (routing replay)."""

    @property
    def live(self) -> int:
        return self.returned.count(False)

    @property
    def full(self) -> bool:
        """Every cache slot is written: rows still running need a new pack."""
        return self.t >= self.tokens.shape[1]

    def forward(self, forward: Forward) -> torch.Tensor:
        if self.t == 0:
            return forward(self.ids, self.mask[:, :self.width], self.positions, self.cache)
        t = self.t
        return forward(self.tokens[:, t - 1][:, None], self.mask[:, :self.width + t],
                       (self.next_position + (t - 1))[:, None], self.cache)

    def record(self, routes: torch.Tensor) -> None:
        """Keep the routes of the forward just run (`forward`: the prefill's slots, or one decode slot)."""
        if self.routes is None:
            self.routes = routes.new_zeros((routes.shape[0], self.mask.shape[1], *routes.shape[2:]))
        if self.t == 0:
            self.routes[:, :self.width] = routes
        else:
            self.routes[:, self.width + self.t - 1] = routes[:, 0]

    def fed_routes(self, row: int) -> torch.Tensor | None:
        """Row `row`'s routes at every position it fed so far (its context and its tokens but the last)."""
        if self.routes is None:
            return None
        pad = self.width - len(self.rows[row].context)
        return self.routes[row, pad:self.width + self.t - 1].cpu()

    def advance(self, new: torch.Tensor, new_logp: torch.Tensor, eos: torch.Tensor, pad_id: int) -> list[int]:
        """Write the sampled tokens; the rows that finished (EOS or their budget) at this step."""
        t = self.t
        self.tokens[:, t] = torch.where(self.done, pad_id, new)
        self.logps[:, t] = torch.where(self.done, 0.0, new_logp)
        ended = ~self.done & (torch.isin(new, eos) | (self.budget <= t + 1))
        self.done |= ended
        self.t += 1
        return torch.nonzero(ended).flatten().tolist()

    def sampled(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s tokens and log-probs over the stream so far (earlier packs, then this one's)."""
        running = self.rows[row]
        return (torch.cat([running.tokens, self.tokens[row, :self.t].cpu()]),
                torch.cat([running.logprobs, self.logps[row, :self.t].cpu()]))


class TorchStream:
    """A stream of requests over `forward` (the engine's model call); see the module docstring."""

    def __init__(self, forward: Forward, sample: Sampler, config, sampling: SamplingParams,
                 generator: torch.Generator, eos: torch.Tensor, pad_id: int, device: torch.device,
                 left_pad: Callable, max_batch: int | None, policy: str = "fill",
                 routes: Routes | None = None) -> None:
        if policy not in ("fill", "drain"):
            raise ValueError(f"policy must be 'fill' or 'drain', got {policy!r}")
        self.forward, self.sample, self.config, self.sampling = forward, sample, config, sampling
        self.generator, self.eos, self.pad_id, self.device = generator, eos, pad_id, device
        self.left_pad, self.max_batch, self.policy = left_pad, max_batch, policy
        self.routes = routes
        self.waiting: deque[Request] = deque()
        self.pack: _Pack | None = None

    def submit(self, requests: list[Request]) -> None:
        for r in requests:
            if r.max_new_tokens < 1 or not r.prompt:
                raise ValueError(f"request {r.key}: needs a prompt and max_new_tokens >= 1")
        self.waiting.extend(requests)

    def pending(self) -> int:
        return len(self.waiting) + (self.pack.live if self.pack is not None else 0)

    def step(self) -> list[Completion]:
        """One forward: rebuild the pack if due, then a token for every running row; the finished rows."""
        if (self.waiting and self._refill_due()) or (self.pack is not None and self.pack.live and
                                                     self.pack.full):
            self._rebuild()
        pack = self.pack
        if pack is None or pack.live == 0:
            self._dummy_forward()
            return []
        logits = pack.forward(self.forward)
        if self.routes is not None:
            pack.record(self.routes(*((len(pack.rows), pack.width) if pack.t == 0 else (len(pack.rows), 1))))
        s = self.sampling
        new, new_logp = self.sample(logits, s.temperature, s.top_p, s.top_k, self.generator)
        finished = []
        for row in pack.advance(new, new_logp, self.eos, self.pad_id):
            tokens, logps = pack.sampled(row)
            eos_end = bool(torch.isin(tokens[-1:], self.eos.cpu()).any())
            pack.returned[row] = True
            finished.append(Completion(pack.rows[row].request.key, tokens, logps, finished=True,
                                       truncated=not eos_end, routes=pack.fed_routes(row)))
        return finished

    def abort(self) -> list[Completion]:
        """Every running and queued request with what it sampled (finished False); the stream is then
        empty."""
        out = []
        if self.pack is not None:
            for row, running in enumerate(self.pack.rows):
                if not self.pack.returned[row]:
                    tokens, logps = self.pack.sampled(row)
                    out.append(Completion(running.request.key, tokens, logps, finished=False,
                                          routes=self.pack.fed_routes(row)))
        empty_t, empty_lp = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float32)
        out += [Completion(r.key, empty_t, empty_lp, finished=False) for r in self.waiting]
        self.waiting.clear()
        self.pack = None
        return out

    def _refill_due(self) -> bool:
        pack = self.pack
        if pack is None or pack.live == 0:
            return True
        if self.policy == "drain":
            return False
        room = self.max_batch is None or pack.live < self.max_batch
        return room and (len(pack.rows) - pack.live) >= REFILL_FINISHED_FRACTION * len(pack.rows)

    def _rebuild(self) -> None:
        rows = []
        if self.pack is not None:
            for row, running in enumerate(self.pack.rows):
                if not self.pack.returned[row]:
                    tokens, logps = self.pack.sampled(row)
                    rows.append(_Running(running.request, tokens, logps))
        limit = self.max_batch or len(rows) + len(self.waiting)
        while self.waiting and len(rows) < limit:
            request = self.waiting.popleft()
            rows.append(
                _Running(request, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float32)))
        horizon = PACK_HORIZON if self.policy == "fill" else None
        self.pack = _Pack(rows, self.pad_id, self.device, self.config, self.left_pad, horizon)

    def _dummy_forward(self) -> None:
        """A one-token forward that keeps this rank's FSDP2 collectives in step with ranks that have work."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        ones = torch.ones_like(ids)
        self.forward(ids, ones, torch.zeros_like(ids), StaticCache(config=self.config, max_cache_len=1))


__all__ = ["TorchStream"]

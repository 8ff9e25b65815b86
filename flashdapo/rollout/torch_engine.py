"""A plain-torch rollout engine: gpt-fast style generation for any HF causal LM, on any device.

The choices, before the code:

- **Batching.** `generate` repeats each prompt `n` times (responses of prompt i are adjacent) and runs
  sub-batches of at most `max_batch` sequences, one after another; a stream (`open_stream`, the
  `StreamingEngine` contract) lets requests join as rows finish (continuous batching, `torch_stream.py`). A
  sub-batch is LEFT-padded so every row's next token sits in the same column; position ids are `cumsum(mask) -
  1`, so RoPE sees each prompt from position 0, exactly as an unpadded forward does.
- **KV cache.** A transformers `StaticCache` preallocated for `prompt + max_new_tokens` slots (the
  gpt-fast layout, and the one `torch.compile`/CUDA graphs can capture later). transformers builds the
  causal mask from cache *slots* and the padding mask from the 2-D attention mask we pass (zero-padded
  to the cache length), so pad slots are never attended to; position ids only feed RoPE.
- **Prefill** projects only the last position onto the vocabulary (`logits_to_keep=1`).
- **Stopping.** A row is finished after its first EOS (kept in the response). Finished rows keep
  being decoded (their inputs are pads and their outputs are dropped) until the batch is rebuilt or every
  row is finished; rows are never compacted inside a cache, so it keeps its shape.
- **Sampling.** logits / temperature (skipped at T = 1), then top-k, then top-p, then an inverse-CDF
  draw: one uniform number per row against the running sum of the exponentials (no host sync; an
  exponential race would draw one random number per vocabulary entry, which cost more than the LM
  head at V = 152k on CPU). Without filters there is no sort. The uniforms come from a `torch.Generator`
  seeded with `derive_seed(sampling.seed, rank)` (ranks in a process group draw independently).
  Same seed, inputs, `max_batch` and rank -> identical Rollouts.
- **Log-probs** are those of the distribution the token was drawn from: `log_softmax(logits.float() / T)`
  renormalized over the survivors of top-k/top-p (vLLM's `processed_logprobs`, so both engines report
  the same quantity and the rollout correction's ratio pi_old / pi_rollout has the right denominator).
  Without filters (the DAPO training setting) that is exactly what the trainer recomputes with
  `kernels.token_logprobs(..., temperature=T)`. They are fp32; in a bf16 model the LM-head matmul itself
  is bf16.
- **Distributed.** Under FSDP2 every forward all-gathers parameters, so all ranks of `process_group`
  must make the same number of forward calls: every step is one forward on every rank, "anything left"
  is agreed by an all-reduce (MAX), and a rank out of work runs a one-token dummy forward. All ranks
  must pass the same `SamplingParams`. Without a group (or with one rank) there are no collectives.
- **Weights.** The engine samples from the module it is given: in training, the FSDP2-sharded policy
  itself, so there is nothing to copy. `wake` gathers every FSDP2 unit once for the whole generation
  (not once per decoded token) and `sleep` reshards them, restoring the training setting.
- **Routes** (`record_routes`, algorithm.routing_replay=r3, mixture-of-experts models): a forward hook on
  every router keeps the top-k experts of the last forward; the stream lays them out per cache slot and hands
  each response the routes of every position it fed (models/moe/replay.py).
- Generation runs under `torch.no_grad` (not `inference_mode`: FSDP2 may keep unsharded parameter
  buffers across calls, and inference tensors cannot be used by the autograd pass that follows), with
  the model in eval mode; its training mode is restored afterwards.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from transformers import StaticCache

from ..distributed.collectives import all_reduce, world_size
from ..models.hf import cache_argument
from ..models.moe import router_logits_kwargs, routers
from ..models.moe.replay import engine_routes
from ..seeds import derive_seed
from .base import Completion, Request, Rollouts, SamplingParams, WeightSource
from .torch_stream import TorchStream

__all__ = ["TorchEngine", "left_pad", "sample"]

CDF_BLOCK = 256
"""Entries per block of the two-level inverse CDF (the vocabulary's largest power-of-two factor up to
this)."""


def _gather_for_generation(model: torch.nn.Module, gather: bool, reshard_after_forward: bool) -> None:
    """Unshard every FSDP2 unit of `model` and keep it so through generation (gather=True), or reshard them
    and restore the training setting (the root never reshards after forward: backward needs it at once)."""
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        if gather:
            unit.unshard()
        unit.set_reshard_after_forward(not gather and reshard_after_forward and unit is not model,
                                       recurse=False)
        if not gather:
            unit.reshard()


def left_pad(
    prompts: list[list[int]], pad_token_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into `input_ids`, `attention_mask` (1 = real token) and `position_ids`.

    All three are [B, max_len] int64; a row's position ids count its real tokens from 0 (pads get 0).
    """
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), positions.to(device)


def _inverse_cdf(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Index drawn per row with probability weights[i] / sum(weights) (weights >= 0, [B, V]).

    One uniform number per row against the running sum: u * total falls in entry i's interval
    [cdf[i-1], cdf[i]) with probability weights[i] / total; an entry of weight 0 has an empty interval
    and is never drawn. In two levels, because a running sum over the whole row is a slow sequential
    pass: block sums (a vectorized reduction) and their running sum pick the block, then the running
    sum inside that one block picks the entry. Running sums of non-negative fp32 values never decrease,
    and each target is kept strictly below its total, so the index is always that of a positive weight.
    """
    rows, vocab = weights.shape
    block = vocab if vocab <= CDF_BLOCK else math.gcd(vocab, CDF_BLOCK)
    if block < CDF_BLOCK // 8:  # a vocabulary with no large power-of-two factor: pad it (a copy)
        block = CDF_BLOCK
        weights = torch.nn.functional.pad(weights, (0, -vocab % block))
    blocks = weights.reshape(rows, -1, block)
    sums = blocks.sum(dim=-1)
    cdf = sums.cumsum(dim=-1)

    def below(target: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        return torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))

    total = cdf[:, -1:]
    u = below(
        torch.rand(total.shape, generator=generator, device=weights.device, dtype=weights.dtype) * total,
        total)
    j = torch.searchsorted(cdf, u, right=True)  # [B, 1]: the block holding u (its sum is > 0)
    inner = blocks.gather(1, j[:, :, None].expand(rows, 1, block)).squeeze(1).cumsum(dim=-1)
    rest = below((u - (cdf.gather(-1, j) - sums.gather(-1, j))).clamp_min(0), inner[:, -1:])
    return (j * block + torch.searchsorted(inner, rest, right=True)).squeeze(-1)


def _sample_filtered(scaled: torch.Tensor, top_p: float, top_k: int,
                     generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens from softmax(scaled) restricted by top-k, then top-p over the renormalized survivors, and
    their log-probs under that renormalized distribution.

    top-k keeps every logit >= the k-th largest (ties at the k-th value are kept); top-p then keeps
    the smallest prefix (by decreasing probability) whose mass reaches top_p; the top token always
    stays. Both read one descending sort of the row, and the draw runs over the sorted survivors.
    """
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    if 0 < top_k < scaled.shape[-1]:
        kth = sorted_logits[:, top_k - 1 : top_k]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    weights = (sorted_logits - sorted_logits[:, :1]).exp_()  # the top entry is the row maximum
    if top_p < 1.0:
        probs = weights / weights.sum(dim=-1, keepdim=True)
        # Drop a token when the tokens ranked above it already reach top_p.
        weights = weights.masked_fill((probs.cumsum(-1) - probs) >= top_p, 0.0)
    picked = _inverse_cdf(weights, generator)[:, None]
    # log(w_picked / sum of the survivors' w), with w_picked = exp(logit - row max): no second exp.
    logp = sorted_logits.gather(-1, picked).squeeze(-1) - sorted_logits[:, 0] - weights.sum(dim=-1).log()
    return order.gather(-1, picked).squeeze(-1), logp


GREEDY_BELOW = 1e-5
"""Smaller sampling temperatures mean greedy decoding (vLLM's threshold)."""


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [B, V]; return (tokens [B] int64, log-probs [B] fp32).

    The distribution is softmax(logits / temperature) after the top-k/top-p filters (top_k <= 0 and
    top_p >= 1 disable them), drawn by inverse CDF: one uniform number per row, not one per vocabulary
    entry. The log-prob is that of the drawn token under the distribution it was drawn from: the
    renormalized survivors of the filters (vLLM's `processed_logprobs`); without filters
    log_softmax(logits / temperature), what the trainer recomputes. Taken from the same exponentials as
    the draw. Temperatures below GREEDY_BELOW draw the argmax with log-prob 0, the T -> 0 limit (vLLM samples
    greedily there too): dividing by them overflows fp32 logits to inf.
    """
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1), torch.zeros(logits.shape[0], device=logits.device)
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    if (0 < top_k < scaled.shape[-1]) or top_p < 1.0:
        return _sample_filtered(scaled, top_p, top_k, generator)
    row_max = scaled.amax(dim=-1, keepdim=True)
    weights = (scaled - row_max).exp_()
    tokens = _inverse_cdf(weights, generator)
    log_total = weights.sum(dim=-1).log()  # a tree reduction: more accurate than the running sum
    picked = scaled.gather(-1, tokens[:, None]).squeeze(-1) - row_max.squeeze(-1)
    return tokens, picked - log_total


def _check_request(prompts: list[list[int]], sampling: SamplingParams) -> None:
    if sampling.n < 1 or sampling.max_new_tokens < 1:
        raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got {sampling}")
    if sampling.temperature <= 0:
        raise ValueError("temperature must be > 0 (greedy decoding: use top_k=1)")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")


class TorchEngine:
    """RolloutEngine over an HF causal LM (plain or FSDP2-sharded), prefill + decode on a static KV cache.

    `max_batch` bounds the sequences (prompts x n) decoded together, hence the KV-cache memory;
    `reshard_after_forward` is the training setting `sleep` restores on an FSDP2 model's blocks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: list[int],
        pad_token_id: int,
        device: torch.device | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        max_batch: int | None = None,
        reshard_after_forward: bool = True,
        record_routes: bool = False,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_batch = max_batch
        self.process_group = process_group
        self.reshard_after_forward = reshard_after_forward
        self._distributed = process_group is not None and world_size(process_group) > 1
        self._rank = dist.get_rank(process_group) if self._distributed else 0
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=self.device)
        self._cache_arg = cache_argument(model)
        # MoE: no router logits and no load-balancing loss in sampling, whatever config.json's
        # output_router_logits says (over a KV cache that loss cannot even be computed: models/moe/router.py).
        self._router_kwargs = router_logits_kwargs(getattr(model, "config", None))
        self._stream: TorchStream | None = None
        self._was_training = model.training
        self._routers = routers(getattr(model, "hf", model)) if record_routes else []
        if record_routes and not self._routers:
            raise ValueError(
                "TorchEngine(record_routes=True) needs a mixture-of-experts model (no router found)")
        self._invariant = bool(getattr(model, "invariant", False))
        """trainer.batch_invariant (models/invariant.py): the model is a batch-invariant policy; its forward
        gives the last hidden states, drawn from and scored by its LM-head kernel (`_invariant_sample`)."""
        self._hidden: torch.Tensor | None = None
        if self._invariant:
            self.sample = self._invariant_sample
        self._captured: list[torch.Tensor] | None = None
        """The routers' top-k indices during an engine forward (None outside: the trainer's forwards run the
        same modules)."""
        self._last_forward: list[torch.Tensor] = []
        for router in self._routers:  # the top-k indices are the router's third output (models/moe/replay.py)
            router.register_forward_hook(self._capture)

    # ---- the RolloutEngine protocol ------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, max_batch: int | None = None
    ) -> Rollouts:
        """Sample `sampling.n` responses per prompt; `max_batch` overrides the constructor's bound. A stream
        that takes sub-batches of at most `max_batch` sequences one after another (policy `drain`)."""
        _check_request(prompts, sampling)
        owners = [i for i in range(len(prompts)) for _ in range(sampling.n)]
        self.open_stream(sampling, max_batch=max_batch, policy="drain")
        self.submit([Request(key=k, prompt=tuple(prompts[i]), max_new_tokens=sampling.max_new_tokens)
                     for k, i in enumerate(owners)])
        done: dict[int, Completion] = {}
        try:
            while self._agree_max(self.pending()):
                done.update((c.key, c) for c in self.step())
        finally:
            self.abort()
        prompt_tensors = [torch.tensor(p, dtype=torch.long) for p in prompts]
        return Rollouts(
            prompt_ids=[prompt_tensors[i] for i in owners],
            response_ids=[done[k].tokens for k in range(len(owners))],
            group_ids=torch.tensor(owners, dtype=torch.long),
            truncated=torch.tensor([done[k].truncated for k in range(len(owners))], dtype=torch.bool),
            logprobs=[done[k].logprobs for k in range(len(owners))],
            routes=[done[k].routes for k in range(len(owners))] if self._routers else None,
        )

    # ---- the StreamingEngine protocol ----------------------------------------------------------

    def open_stream(self, sampling: SamplingParams, max_batch: int | None = None,
                    policy: str = "fill") -> None:
        """Start a stream (`torch_stream.py`): the model in eval mode until `abort` ends it."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(derive_seed(sampling.seed, self._rank))  # ranks sample different prompts
        self._was_training = self.model.training
        self.model.eval()
        self._stream = TorchStream(self._forward, self.sample, self.model.config, sampling, generator,
                                   self._eos, self.pad_token_id, self.device, left_pad, max_batch or
                                   self.max_batch, policy,
                                   routes=self._last_routes if self._routers else None)

    def submit(self, requests: list[Request]) -> None:
        """Queue requests on the open stream."""
        self._stream.submit(requests)

    def step(self) -> list[Completion]:
        """One forward of the open stream (every rank together); the requests that finished."""
        with torch.no_grad():
            return self._stream.step()

    def abort(self) -> list[Completion]:
        """End the open stream: what every unfinished request sampled; the model's training mode back."""
        stream, self._stream = self._stream, None
        self.model.train(self._was_training)
        return stream.abort() if stream is not None else []

    def pending(self) -> int:
        """Requests of the open stream on this rank not yet returned (0 without one)."""
        return self._stream.pending() if self._stream is not None else 0

    def wake(self, weights: WeightSource | None = None, version: int | None = None) -> None:
        """Gather an FSDP2 model's shards for the whole generation. `weights` and `version` are never read:
        the engine samples from the policy module itself, which always holds the current weights."""
        if isinstance(self.model, FSDPModule):
            _gather_for_generation(self.model, True, self.reshard_after_forward)

    def sleep(self, keep_awake: bool = False) -> None:
        """Reshard an FSDP2 model, also with `keep_awake`: the trainer's state dicts and optimizer need the
        sharded parameters back, and a gather is cheap next to a generation. (The static KV caches live only
        for the duration of one `generate`.)"""
        if isinstance(self.model, FSDPModule):
            _gather_for_generation(self.model, False, self.reshard_after_forward)

    # ---- gpt-fast verbs --------------------------------------------------------------------------

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: StaticCache,
    ) -> torch.Tensor:
        """Run left-padded prompts [B, P] through the model into `cache`; next-token logits [B, V] fp32."""
        return self._forward(input_ids, attention_mask, position_ids, cache)

    def decode_one_token(
        self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor, cache: StaticCache
    ) -> torch.Tensor:
        """Feed one token per row (tokens, positions: [B]); next-token logits [B, V] fp32.

        `attention_mask` [B, slots so far + 1] marks the valid cache slots (left pads are 0).
        """
        return self._forward(tokens[:, None], attention_mask, positions[:, None], cache)

    sample = staticmethod(sample)

    # ---- internals ---------------------------------------------------------------------------------

    def _last_routes(self, batch: int, width: int) -> torch.Tensor:
        """The last forward's routes, [batch, width, sparse layers, top_k] (record_routes)."""
        return engine_routes(self._last_forward, batch, width, int(self._routers[0].num_experts))

    def _capture(self, _module, _inputs, output) -> None:
        if self._captured is not None:
            self._captured.append(output[2].detach())

    def _invariant_sample(self, logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                          top_k: int = -1, generator: torch.Generator | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample`'s draw, with each drawn token's log-prob from the policy's LM-head kernel on the step's
        hidden states (invariant=True): the bits the trainer's old-log-prob pass and update give it. With
        top-p/top-k (validation's sampling; training's is refused by trainer.batch_invariant) the filters'
        renormalized log-probs, which no trainer pass computes."""
        if top_p < 1.0 or 0 < top_k < logits.shape[-1]:
            return sample(logits, temperature, top_p, top_k, generator)
        tokens, _ = sample(logits, temperature, top_p, top_k, generator)
        return tokens, self.model.sampled_logprobs(self._hidden, tokens, temperature)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        self._captured = [] if self._routers else None
        if self._invariant:
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=True, hidden_only=True, **{self._cache_arg: cache})
            self._hidden = hidden[:, -1]
            self._last_forward, self._captured = self._captured or [], None
            return self.model.sampling_logits(self._hidden)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,  # only the last position is projected onto the vocabulary
            **{self._cache_arg: cache},
            **self._router_kwargs,
        )
        self._last_forward, self._captured = self._captured or [], None
        return out.logits[:, -1].float()

    def _agree_max(self, value: int) -> int:
        """The maximum of `value` over the process group (the value itself without one)."""
        if not self._distributed:
            return value
        return int(all_reduce(torch.tensor([value], device=self.device), "max", self.process_group).item())

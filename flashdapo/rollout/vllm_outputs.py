"""Between vLLM and the engine contract's types: our SamplingParams into vLLM's, and vLLM's outputs back: the
sampled tokens' log-probs, `RequestOutput`s into `Rollouts` (vLLM 0.33.0 and the 0.32.0 CPU build:
`sampling_params.py`, `outputs.py` `RequestOutput` / `CompletionOutput`, `logprobs.py` `FlatLogprobs`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..models.moe.replay import route_dtype
from .base import Rollouts, SamplingParams


def vllm_sampling_params(vllm: Any, sampling: SamplingParams, *, n: int, seed: int, max_tokens: int,
                         **extra: Any) -> Any:
    """vLLM's SamplingParams for `sampling` (the one mapping of every generate call and stream request): the
    sampled token's log-prob only (`logprobs=0`, flat), no detokenizing, top_k off as 0; `extra` (e.g. the
    stream's output_kind) passed through.

    Token ids the tokenizer does not have (`vllm.banned_token_ids`, set by the engine: the padded rows of the
    model's vocabulary, ids >= len(tokenizer)) get a logit bias of -inf: they are never sampled, and the
    log-probs vLLM reports (processed_logprobs, computed after the bias) are those of the distribution it
    sampled from, the policy's renormalized over the tokenizer's ids. `logit_bias` is what vLLM 0.32-0.34
    all apply on every path (0.32/0.33 `v1/sample/logits_processor/builtin.py` LogitBiasLogitsProcessor, 0.34
    `v1/worker/gpu/sample/logit_bias.py`, at most 1024 ids a request); `allowed_token_ids` would list the
    whole tokenizer, beyond 0.34's 1024.

    `vllm.stop_token_ids` (set by the engine: flashdapo's stop set, tokenizer.eos_token_ids) go in as
    `stop_token_ids`: vLLM ends the request there with finish reason "stop", the token kept in token_ids (as
    its own eos), so both engines stop on the same ids whatever vLLM reads from generation_config.json."""
    banned = getattr(vllm, "banned_token_ids", ())
    if banned:
        extra.setdefault("logit_bias", dict.fromkeys(banned, float("-inf")))
    stop = getattr(vllm, "stop_token_ids", ())
    if stop:
        extra.setdefault("stop_token_ids", [int(i) for i in stop])
    return vllm.SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                               top_k=sampling.top_k if sampling.top_k > 0 else 0, max_tokens=max_tokens,
                               logprobs=0, seed=seed, detokenize=False, flat_logprobs=True, **extra)


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> torch.Tensor:
    """fp32 log-prob of each sampled token from vLLM's per-position logprobs (FlatLogprobs or dicts)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token log-probs (SamplingParams.logprobs must be 0)")
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: with logprobs=0, one entry per position
        if list(logprobs.token_ids) == list(token_ids):
            return torch.tensor(logprobs.logprobs, dtype=torch.float32)
        values = []
        for pos, tok in enumerate(token_ids):
            span = range(logprobs.start_indices[pos], logprobs.end_indices[pos])
            values.append(next(logprobs.logprobs[i] for i in span if logprobs.token_ids[i] == tok))
        return torch.tensor(values, dtype=torch.float32)
    return torch.tensor([position[tok].logprob for position, tok in zip(logprobs, token_ids, strict=True)],
                        dtype=torch.float32)


def to_rollouts(outputs: Sequence[Any], prompts: Sequence[Sequence[int]], n: int) -> Rollouts:
    """`Rollouts` from vLLM `RequestOutput`s (one per prompt, in order; `n` completions each)."""
    if len(outputs) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    prompt_ids, response_ids, group_ids, truncated, logprobs, routes = [], [], [], [], [], []
    for group, (request, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for a prompt, expected n={n}")
        prompt_tensor = torch.tensor(list(prompt), dtype=torch.long)
        for completion in completions:
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a request with reason {completion.finish_reason!r}")
            prompt_ids.append(prompt_tensor)
            response_ids.append(torch.tensor(list(completion.token_ids), dtype=torch.long))
            group_ids.append(group)
            truncated.append(completion.finish_reason == "length")
            logprobs.append(sampled_logprobs(completion.token_ids, completion.logprobs))
            # enable_return_routed_experts (Model Runner V2)
            recorded = getattr(completion, "routed_experts", None)
            routes.append(None if recorded is None else torch.from_numpy(recorded.astype("int64")))
    return Rollouts(prompt_ids=prompt_ids, response_ids=response_ids,
                    group_ids=torch.tensor(group_ids, dtype=torch.long),
                    truncated=torch.tensor(truncated, dtype=torch.bool), logprobs=logprobs,
                    routes=routes if all(r is not None for r in routes) and routes else None)


class RouteCapture:
    """The experts vLLM's routers pick, captured in this process (external_launcher runs the worker here) by a
    forward hook on every sparse block's router (`...mlp.gate`, vLLM's GateLinear: router logits first) while
    `capturing`: routing replay's record where vLLM does not return `CompletionOutput.routed_experts` (its
    AuxOutput needs Model Runner V2, which needs Triton, absent from the CPU build)."""

    def __init__(self, top_k: int, num_experts: int) -> None:
        self.top_k, self.num_experts = top_k, num_experts
        self.capturing = False
        self.layers = 0
        self.logits: list[list[torch.Tensor]] = []
        """Per sparse layer, the router logits of each forward while capturing, in order."""

    def install(self, model: Any) -> int:
        """Hook the routers of vLLM's `model` (called through `LLM.apply_model`); how many were found."""
        gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        for layer, gate in enumerate(gates):
            gate.register_forward_hook(lambda _m, _i, out, layer=layer: self._keep(layer, out))
        self.layers = len(gates)
        return len(gates)

    def _keep(self, layer: int, out: Any) -> None:
        if self.capturing:
            self.logits[layer].append((out[0] if isinstance(out, tuple) else out).detach().float().cpu())

    def start(self) -> None:
        self.logits, self.capturing = [[] for _ in range(self.layers)], True

    def routes(self, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Stop capturing; the routes of sequences of `lengths` prefilled in order since `start`, each
        [length, sparse layers, top_k] (the top-k of the router logits: softmax keeps their order)."""
        self.capturing = False
        per_layer = [torch.cat(parts) if parts else torch.zeros(0, self.num_experts) for parts in self.logits]
        rows = {len(t) for t in per_layer}
        if rows != {sum(lengths)}:
            raise RuntimeError(
                f"routing replay: vLLM's routers saw {sorted(rows)} positions for {len(lengths)} "
                f"sequences of {sum(lengths)} positions")
        top = torch.stack([t.topk(self.top_k, dim=-1).indices for t in per_layer], dim=1)
        return list(torch.split(top.to(route_dtype(self.num_experts)), list(lengths)))

"""What every rollout engine takes and returns, and the contract the trainer calls it through.

Per step, on every rank together, whatever the engine:

    engine.wake(weights, version)  # make `generate` sample from the policy's current weights
    rollouts = engine.generate(prompts, SamplingParams(..., seed=derive_seed(seed, step, round)))
    engine.sleep()                 # give back what generation held, before the trainer's passes

`weights(dtype)` yields the policy's full HF-named tensors (a `sync.WeightSource`, the one source of them):
an engine with its own copy of the model (vLLM) consumes it; one that samples from the policy module
itself (the torch engine) never calls it.

Streaming (`StreamingEngine`, both engines): between wake and sleep the trainer may instead open a stream,
submit one `Request` per response, call `step()` (every rank together, the same number of times) to receive
each response the moment it finishes, and `abort()` the rest, getting back what each had sampled so far.
A request may carry a `prefix`: response tokens sampled earlier (a partial rollout carried over a weight
update), prefilled under the current weights and never re-sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import RolloutConfig
from ..sync import WeightSource  # called with a dtype: the tensors; every rank together, to the end


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of responses."""

    n: int = 1
    """Responses per prompt (the group size G)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    max_new_tokens: int = 256
    seed: int = 0
    """Base seed of this call; engines derive per-request seeds from it so that runs repeat."""


def sampling_params(rollout: RolloutConfig, seed: int, n: int | None = None) -> SamplingParams:
    """Training's sampling settings (rollout.*) for one generate call or stream: `n` responses per prompt
    (default rollout.n), up to rollout.max_response_length tokens, seeded by `seed`."""
    return SamplingParams(n=rollout.n if n is None else n, temperature=rollout.temperature,
                          top_p=rollout.top_p, top_k=rollout.top_k,
                          max_new_tokens=rollout.max_response_length, seed=seed)


@dataclass
class Rollouts:
    """A batch of sampled responses, `n` per prompt, grouped: response i belongs to prompt group_ids[i].

    Ragged sequences are stored as lists of 1-D int64 tensors (no padding): the trainer packs them.
    """

    prompt_ids: list[torch.Tensor]
    """Prompt token ids of each response (the same tensor object for the n responses of a prompt)."""
    response_ids: list[torch.Tensor]
    """Sampled response token ids, including the EOS token when one was sampled."""
    group_ids: torch.Tensor
    """[B] int64: index of the prompt (in the batch passed to generate) each response answers."""
    truncated: torch.Tensor
    """[B] bool: generation hit max_new_tokens without an EOS (vLLM finish reason "length")."""
    logprobs: list[torch.Tensor] | None = None
    """Per-token log-probs of the sampled tokens under the sampler's distribution (fp32), if known."""
    routes: list[torch.Tensor] | None = None
    """Mixture-of-experts routing replay (algorithm.routing_replay=r3): per response, the experts the engine
    routed each fed position to, [prompt + response - 1, sparse layers, top_k] small ints
    (models/moe/replay.py); None when not recorded."""

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] int64 number of response tokens."""
        return torch.tensor([len(r) for r in self.response_ids], dtype=torch.long)

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return torch.tensor([len(p) for p in self.prompt_ids], dtype=torch.long)


@dataclass(frozen=True)
class Request:
    """One response to sample in a stream."""

    key: int
    """The caller's name for it, unique among the stream's requests."""
    prompt: tuple[int, ...]
    prefix: tuple[int, ...] = ()
    """Response tokens already sampled (a carried partial rollout): prefilled after the prompt, not
    re-sampled."""
    max_new_tokens: int = 256
    """Tokens it may still sample (the response's limit minus the prefix)."""
    seed: int = 0
    """Its own sampling seed (engines that seed per request: vLLM); the torch engine draws from the
    stream's."""


@dataclass
class Completion:
    """What a request sampled in this stream: all of it (finished) or up to an abort (finished False)."""

    key: int
    tokens: torch.Tensor
    """[t] int64 tokens sampled after the prefix (including the EOS token when one was sampled)."""
    logprobs: torch.Tensor
    """[t] fp32 log-probs of those tokens under the distribution they were drawn from."""
    finished: bool
    """Ended by EOS or by its max_new_tokens; False: aborted while in flight or waiting."""
    truncated: bool = False
    """Finished by max_new_tokens without an EOS."""
    routes: torch.Tensor | None = None
    """Routing replay: the experts the engine routed each position of prompt + prefix + tokens to, but the
    last token (never fed), [positions, sparse layers, top_k]; None when not recorded."""


class StreamingEngine(Protocol):
    """Per-response streaming on top of the RolloutEngine contract: continuous batching inside the engine.

    Every call is collective over the ranks of the trainer's process group: all ranks open, step and abort
    together (a rank with nothing in flight still steps: the engine keeps its collectives in step). What a
    step returns is a function of what was submitted, in order, and of the seeds: never of the clock.
    """

    def open_stream(self, sampling: SamplingParams) -> None:
        """Start a stream sampling with `sampling` (its n is ignored: one response per request; its seed
        seeds the stream)."""
        ...

    def submit(self, requests: list[Request]) -> None:
        """Queue requests; they join the decode batch as it has room (in submission order)."""
        ...

    def step(self) -> list[Completion]:
        """Advance every running request by one engine step; the requests that finished in it."""
        ...

    def abort(self) -> list[Completion]:
        """End the stream: every request still running or queued, with what it sampled (finished False)."""
        ...

    def pending(self) -> int:
        """Requests of this rank submitted and not yet returned."""
        ...


class RolloutEngine(Protocol):
    """Samples responses from the current policy. Engines are stateful (weights, caches, memory)."""

    def wake(self, weights: WeightSource, version: int | None = None) -> None:
        """Make the next `generate` calls sample from the policy's current weights (loading them from
        `weights` if the engine holds its own copy) and re-acquire generation memory. `version` numbers the
        policy's weights (it changes with every update): an engine still awake with that version may skip
        the load."""
        ...

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        """Sample `sampling.n` responses for each prompt (token ids); group_ids index `prompts`."""
        ...

    def sleep(self, keep_awake: bool = False) -> None:
        """Release what generation holds (memory, gathered parameters) while the trainer runs. `keep_awake`:
        the next `wake` brings the same version and the trainer needs no memory before it, so an engine
        may stay as it is."""
        ...

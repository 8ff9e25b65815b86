"""The `StreamingEngine` contract (rollout/base.py) over vLLM's step-wise engine, for `VLLMEngine`.

Written against the 0.32.0 CPU build (paths below are inside it) and run there (tests/vllm). Not yet checked
against vLLM 0.33.0's source: on CUDA the same calls are assumed, and `tests/rollout/test_vllm_stream.py`
compares the stand-in's signatures with the installed vLLM's, wherever one is installed.

- **Calls.** On `llm.llm_engine` (`v1/engine/llm_engine.py`): `add_request(request_id, {"prompt_token_ids":
  prompt + prefix}, SamplingParams(n=1, seed=request.seed, max_tokens=request.max_new_tokens, temperature,
  top_p, top_k (off = 0), logprobs=0, detokenize=False, flat_logprobs=True, output_kind=DELTA))`, `step()`,
  `abort_request(ids)`, `has_unfinished_requests()`. The sampling fields and the log-prob conversion are
  those of `VLLMEngine.generate` (`vllm_outputs.py`): processed log-probs, fp32; finish reason "length"
  (max_tokens or max_model_len) is truncated, "stop" (EOS, kept) is not, anything else raises.
- **Deltas.** With `RequestOutputKind.DELTA` each step's `RequestOutput` of a request carries only its new
  tokens and their log-probs (`v1/engine/output_processor.py` `_new_completion_output`: the log-probs are
  the last len(new tokens) of the ones accumulated). The stream keeps every delta, because an aborted
  request emits nothing more: `abort_request` drops it from the output processor and the scheduler.
  What an abort returns is what the deltas carried (a request still waiting for its prefill: nothing).
- **Ids.** vLLM appends 8 random characters to each request id for its own bookkeeping
  (`v1/engine/input_processor.py` `assign_request_id`) and reports outputs and takes aborts under the id it
  was given; the scheduler orders by arrival (FCFS), never by id.
- **Order.** A request joins vLLM at the first `step()` after its `submit` (the step gathers a TP group's
  submissions, below), the requests of one step in submission order; vLLM's scheduler admits waiting
  requests in that order as the batch has room. What a step finishes is returned in submission order.
  So the completions, and the step each arrives in, are a function of the submissions and the steps
  they fell between: on the CPU build a stream repeated with the same submissions at the same steps
  returns the same completions in the same order, tokens and log-probs bitwise, and a stream that submits
  everything before its first step returns `generate`'s tokens for the same seeds
  (tests/vllm/test_vllm_stream.py). A step with nothing in flight does not call vLLM.
- **Async scheduling.** CUDA vLLM may overlap scheduling with execution (`scheduler_config.async_scheduling`,
  two batches in flight, `v1/engine/core.py` `step_with_batch_queue`): a step may then return nothing while
  a batch computes, and an abort loses the tokens of the batch in flight (the partial stays a prefix of what
  the request would have sampled). The CPU platform turns it off (`platforms/cpu.py`).
- **TP groups.** The ranks of a TP group must give vLLM identical requests at the same steps. `submit` is
  local (each rank may submit when its own responses finish); each `step` first all-gathers the submissions
  made since the last one inside the TP group (rank order), and every rank adds the concatenation, named
  (source rank, key). Each rank returns only its own requests' completions and partials; all ranks of the
  group track, step and abort the same requests. With tensor_parallel_size 1 nothing is gathered.
- **Seeds.** Each request samples from its own generator seeded with `Request.seed` (n=1: no child
  offsets); the caller makes seeds distinct and repeatable. A request resumed with a prefix restarts its
  generator: its new tokens are not the ones an uninterrupted request would have drawn.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import Completion, Request, SamplingParams
from .vllm_outputs import sampled_logprobs, vllm_sampling_params
from .vllm_process import torch_threads


def output_kind_delta(vllm: Any) -> Any:
    """`vllm.sampling_params.RequestOutputKind.DELTA` (a stand-in module may carry `RequestOutputKind`)."""
    kinds = getattr(vllm, "RequestOutputKind", None)
    if kinds is None:
        kinds = importlib.import_module(f"{vllm.__name__}.sampling_params").RequestOutputKind
    return kinds.DELTA


@dataclass
class _Flight:
    """A request of the TP group inside vLLM, with the deltas it returned so far."""

    source: int
    """The TP rank that submitted it."""
    order: int
    """Its place among the group's requests of this stream (submission order)."""
    request: Request
    chunks: list[tuple[Any, Any]] = field(default_factory=list)
    """(token ids, log-probs) of each delta."""

    def completion(self, finished: bool, truncated: bool = False) -> Completion:
        tokens = [int(t) for ids, _ in self.chunks for t in ids]
        parts = [sampled_logprobs(ids, lps) for ids, lps in self.chunks]
        logprobs = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)
        return Completion(key=self.request.key, tokens=torch.tensor(tokens, dtype=torch.long),
                          logprobs=logprobs, finished=finished, truncated=truncated)


class VLLMStream:
    """One open stream over `llm.llm_engine`; `VLLMEngine.open_stream` builds it, `abort` ends it."""

    def __init__(self, engine: Any, vllm: Any, sampling: SamplingParams, *, tp_rank: int,
                 gather: Callable[[Any], list[Any]], threads: int, lora_request: Any = None) -> None:
        """`engine`: vLLM's `LLMEngine`; `vllm`: the package (for `SamplingParams`); `gather`: the all-gather
        of a Python object inside this rank's TP group, in rank order; `threads`: torch's thread count
        while vLLM runs; `lora_request`: the pushed adapter every request names (LoRA; None: the model)."""
        self.engine, self.vllm, self.sampling = engine, vllm, sampling
        self.lora_request = lora_request
        self.tp_rank, self.gather, self.threads = tp_rank, gather, threads
        self._delta = output_kind_delta(vllm)
        self._queued: list[Request] = []  # this rank's, submitted since the last step
        self._keys: set[int] = set()  # this rank's keys in this stream
        self._flights: dict[str, _Flight] = {}  # the TP group's requests inside vLLM, by request id
        self._added = 0
        self._closed = False

    def submit(self, requests: list[Request]) -> None:
        """Queue requests on this rank; they reach vLLM at the next `step`."""
        self._check_open()
        for request in requests:
            if request.key in self._keys:
                raise ValueError(f"request key {request.key} was already submitted to this stream")
            if request.max_new_tokens < 1 or not request.prompt:
                raise ValueError(f"request {request.key}: needs a prompt and max_new_tokens >= 1 "
                                 f"(got {len(request.prompt)} prompt tokens, {request.max_new_tokens})")
            self._keys.add(request.key)
            self._queued.append(request)

    def step(self) -> list[Completion]:
        """Add the TP group's new submissions, run one vLLM step, return this rank's finished requests."""
        self._check_open()
        submitted = self.gather(self._queued)
        self._queued = []
        if not self._flights and not any(submitted):
            return []
        with torch_threads(self.threads):
            for source, requests in enumerate(submitted):
                for request in requests:
                    self._add(source, request)
            outputs = self.engine.step()
        done: list[tuple[_Flight, bool]] = []
        for output in outputs:
            flight = self._flights.get(output.request_id)
            if flight is None:
                raise RuntimeError(f"vLLM stepped request {output.request_id!r}, which no stream submitted")
            if len(output.outputs) != 1:
                raise RuntimeError(f"vLLM returned {len(output.outputs)} completions for a stream request")
            delta = output.outputs[0]
            if len(delta.token_ids):
                flight.chunks.append((delta.token_ids, delta.logprobs))
            if output.finished:
                if delta.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a request with reason {delta.finish_reason!r}")
                del self._flights[output.request_id]
                if flight.source == self.tp_rank:
                    done.append((flight, delta.finish_reason == "length"))
        done.sort(key=lambda item: item[0].order)
        return [flight.completion(True, truncated) for flight, truncated in done]

    def abort(self) -> list[Completion]:
        """End the stream: abort the group's requests in vLLM (every rank of the group the same ones) and
        return this rank's unfinished ones, in submission order, with what they sampled."""
        self._check_open()
        self._closed = True
        if self._flights:
            with torch_threads(self.threads):
                self.engine.abort_request(list(self._flights))
        mine = sorted((f for f in self._flights.values() if f.source == self.tp_rank), key=lambda f: f.order)
        partials = [f.completion(False) for f in mine]
        partials += [_Flight(self.tp_rank, -1, r).completion(False) for r in self._queued]
        self._flights, self._queued = {}, []
        if self.engine.has_unfinished_requests():
            raise RuntimeError("vLLM still has unfinished requests after the stream aborted its own: "
                               "something else added requests to its engine")
        return partials

    def pending(self) -> int:
        """This rank's requests submitted and not yet returned."""
        return len(self._queued) + sum(f.source == self.tp_rank for f in self._flights.values())

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the stream was aborted: open a new one")

    def _add(self, source: int, request: Request) -> None:
        request_id = f"flashdapo-stream-{source}-{request.key}"
        params = vllm_sampling_params(self.vllm, self.sampling, n=1, max_tokens=request.max_new_tokens,
                                      seed=request.seed, output_kind=self._delta)
        prompt = {"prompt_token_ids": [int(t) for t in request.prompt] + [int(t) for t in request.prefix]}
        adapter = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        self.engine.add_request(request_id, prompt, params, **adapter)
        self._flights[request_id] = _Flight(source, self._added, request)
        self._added += 1

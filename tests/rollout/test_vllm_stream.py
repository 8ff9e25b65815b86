"""VLLMEngine's streaming (vllm_stream.py) against a double of vLLM's step-wise `LLMEngine` surface
(tests/helpers/vllm_double.py).

The double mirrors what the stream relies on (vLLM 0.32.0 `v1/engine/llm_engine.py`, `output_processor.py`):
add_request(request_id, prompt, params), FCFS admission as the batch has room, one token per running
request per step, DELTA outputs (new tokens and their FlatLogprobs only), abort_request dropping requests
without a last output, has_unfinished_requests; each request samples from a generator seeded with its own
seed. Real vLLM: tests/vllm/test_vllm_stream.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import threading

import pytest
import torch

from flashdapo.rollout.base import Request, SamplingParams
from tests.helpers.vllm_double import (
    EOS,
    STREAM_VLLM,
    FakeStepEngine,
    RequestOutputKind,
    StreamSamplingParams,
    make_engine,
    names,
    push,
    script,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# Every test runs as a torchrun rank 0 whose thread count is restored (tests/rollout/conftest.py).
pytestmark = pytest.mark.usefixtures("torchrun_env")


SAMPLING = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=-1, seed=123)


def stream_engine(**kwargs):
    engine = make_engine(vllm_module=STREAM_VLLM, **kwargs)
    push(engine)
    return engine


def requests(keys, max_new_tokens=6, prefix=()):
    return [Request(key=k, prompt=(5, 6, k), prefix=prefix, max_new_tokens=max_new_tokens + k % 3, seed=1000 + k)
            for k in keys]


def run_to_end(engine, steps=100):
    """(step index, completion) of everything the open stream returns until nothing is pending."""
    out = []
    for i in range(steps):
        out += [(i, c) for c in engine.step()]
        if not engine.pending():
            return out
    raise AssertionError("stream never drained")


def as_tuple(c):
    return c.key, c.tokens.tolist(), c.logprobs.tolist(), c.finished, c.truncated


def test_stream_samples_each_request_from_its_seed_with_generates_fields():
    engine = stream_engine()
    engine.open_stream(SAMPLING)
    submitted = requests(range(5)) + [Request(key=9, prompt=(7,), prefix=(11, 12), max_new_tokens=3, seed=77)]
    engine.submit(submitted)
    assert engine.pending() == 6 and names(engine.llm.llm_engine.calls) == []  # joins at the next step
    got = run_to_end(engine)
    adds = [c for c in engine.llm.llm_engine.calls if c[0] == "add"]
    assert [c[2] for c in adds] == [list(r.prompt) + list(r.prefix) for r in submitted]
    for (_, _, _, params), request in zip(adds, submitted, strict=True):
        assert (params.n, params.seed, params.max_tokens, params.logprobs) == (1, request.seed,
                                                                              request.max_new_tokens, 0)
        assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.9, 0)
        assert params.detokenize is False and params.flat_logprobs is True
        assert params.output_kind is RequestOutputKind.DELTA
    assert sorted(c.key for _, c in got) == [r.key for r in submitted]
    by_key = {r.key: r for r in submitted}
    for _, c in got:
        tokens, logprobs, reason = script(by_key[c.key].seed, by_key[c.key].max_new_tokens)
        assert c.tokens.tolist() == tokens and c.tokens.dtype == torch.long
        assert c.logprobs.dtype == torch.float32 and c.logprobs.tolist() == torch.tensor(logprobs).tolist()
        assert c.finished and c.truncated == (reason == "length") and (c.tokens[-1] == EOS) != c.truncated
    assert {c.truncated for _, c in got} == {True, False}  # EOS and max_new_tokens both covered
    order = [(i, [r.key for r in submitted].index(c.key)) for i, c in got]
    assert order == sorted(order) and len({i for i, _ in got}) > 1  # by step, then submission order
    assert engine.abort() == [] and not engine.llm.llm_engine.has_unfinished_requests()


def test_a_stream_with_the_same_submissions_repeats():
    def run():
        engine = stream_engine()
        engine.open_stream(SAMPLING)
        engine.submit(requests(range(4)))
        got = [(i, as_tuple(c)) for i in range(3) for c in engine.step()]
        engine.submit(requests(range(4, 7)))  # a refill mid-stream, as the collector does
        got += [(i, as_tuple(c)) for i, c in run_to_end(engine)]
        engine.abort()
        return got

    first = run()
    assert len(first) == 7 and first == run()


def test_abort_returns_every_unfinished_request_with_a_prefix_of_its_sample():
    engine = stream_engine()
    engine.open_stream(SAMPLING)
    submitted = requests(range(6), max_new_tokens=8)  # 3 run, 3 wait in vLLM
    engine.submit(submitted)
    finished = engine.step() + engine.step()
    engine.submit(requests([20]))  # never stepped: comes back empty
    step_engine = engine.llm.llm_engine
    emitted = {r.request_id: r.emitted for r in step_engine.running.values()}  # waiting ones: none yet
    partials = engine.abort()
    assert [c.key for c in partials] == [r.key for r in submitted if r.key not in {c.key for c in finished}] + [20]
    by_key = {r.key: r for r in submitted + requests([20])}
    for c in partials:
        tokens, logprobs, _ = script(by_key[c.key].seed, by_key[c.key].max_new_tokens)
        assert not c.finished and not c.truncated and len(c.tokens) < len(tokens)
        assert c.tokens.tolist() == tokens[:len(c.tokens)] and c.logprobs.dtype == torch.float32
        assert c.logprobs.tolist() == torch.tensor(logprobs[:len(c.tokens)]).tolist()
    assert [len(c.tokens) for c in partials] == [emitted.get(f"flashdapo-stream-0-{c.key}", 0) for c in partials]
    assert {len(c.tokens) > 0 for c in partials} == {True, False}  # running ones and waiting ones
    assert not step_engine.has_unfinished_requests() and engine.pending() == 0
    assert sorted(step_engine.calls[-1][1]) == sorted(f"flashdapo-stream-0-{c.key}" for c in partials[:-1])
    with pytest.raises(RuntimeError, match="no stream is open"):
        engine.step()
    engine.sleep()  # the weights push and generate work again
    push(engine)
    assert len(engine.generate([[1]], SamplingParams(max_new_tokens=2))) == 1


def test_no_generate_score_or_sleep_while_a_stream_is_open_and_bad_requests_refused():
    engine = stream_engine()
    engine.open_stream(SAMPLING)
    for call in (lambda: engine.generate([[1]], SAMPLING), lambda: engine.score([[1, 2]]), engine.sleep,
                 lambda: engine.open_stream(SAMPLING)):
        with pytest.raises(RuntimeError, match="while a stream is open: abort"):
            call()
    engine.submit(requests([1]))
    with pytest.raises(ValueError, match="request key 1 was already submitted"):
        engine.submit(requests([1]))
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        engine.submit([Request(key=2, prompt=(1,), max_new_tokens=0)])
    engine.llm.llm_engine.finish_override = "abort"
    with pytest.raises(RuntimeError, match="vLLM finished a request with reason 'abort'"):
        run_to_end(engine)
    asleep = stream_engine()
    asleep.sleep()
    with pytest.raises(RuntimeError, match="open_stream while asleep"):
        asleep.open_stream(SAMPLING)


def test_a_step_with_nothing_in_flight_does_not_call_vllm():
    engine = stream_engine()
    engine.open_stream(SAMPLING)
    assert engine.step() == [] and engine.llm.llm_engine.calls == []


class ThreadGather:
    """The TP group's all-gather of Python objects, between threads standing in for its ranks."""

    def __init__(self, ranks):
        self.barrier, self.slots = threading.Barrier(ranks), [None] * ranks

    def for_rank(self, rank):
        def gather(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return gather


def test_tp_group_gathers_at_each_step_submits_identically_and_returns_each_rank_its_own():
    gather = ThreadGather(2)
    engines = [stream_engine(rank=r, world_size=2, tp_gather=gather.for_rank(r), tensor_parallel_size=2)
               for r in (0, 1)]
    plans = {0: {0: requests([1, 2]), 3: requests([3])}, 1: {0: requests([1], max_new_tokens=9), 2: requests([7])}}
    got, errors = {}, []

    def rank_main(rank):
        try:
            engine, out = engines[rank], []
            engine.open_stream(SAMPLING)
            for i in range(5):  # every rank steps together, whatever it submitted
                engine.submit(plans[rank].get(i, []))
                out += [("done", as_tuple(c)) for c in engine.step()]
            out += [("partial", as_tuple(c)) for c in engine.abort()]
            got[rank] = out
        except Exception as err:  # surfaced below, from the main thread
            errors.append(err)
            gather.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    calls = [e.llm.llm_engine.calls for e in engines]
    assert calls[0] == calls[1]  # identical requests, steps and aborts on both ranks of the group
    ids = [c[1] for c in calls[0] if c[0] == "add"]
    assert ids == ["flashdapo-stream-0-1", "flashdapo-stream-0-2", "flashdapo-stream-1-1",
                   "flashdapo-stream-1-7", "flashdapo-stream-0-3"]  # step order, then rank order
    for rank in (0, 1):
        mine = {r.key: r for step in plans[rank].values() for r in step}
        assert sorted(k for _, (k, *_) in got[rank]) == sorted(mine)  # every own request, once, no other's
        for kind, (key, tokens, _, finished, _) in got[rank]:
            full, _, _ = script(mine[key].seed, mine[key].max_new_tokens)
            assert finished == (kind == "done") and tokens == full[:len(tokens)]
            assert (tokens == full) == finished
        assert any(kind == "partial" for kind, _ in got[rank]) and engines[rank].pending() == 0


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_the_calls_bind_to_the_installed_vllm():
    import vllm
    from vllm.v1.engine.llm_engine import LLMEngine

    from flashdapo.rollout.vllm_stream import output_kind_delta

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for method in ("add_request", "step", "abort_request", "has_unfinished_requests"):
        assert shape(getattr(FakeStepEngine, method)) == shape(getattr(LLMEngine, method)), method
    fields = {f.name for f in dataclasses.fields(StreamSamplingParams)}
    real = {f.name: f.default for f in dataclasses.fields(vllm.SamplingParams)} if dataclasses.is_dataclass(
        vllm.SamplingParams) else dict(inspect.signature(vllm.SamplingParams).parameters)
    assert fields <= set(real)
    params = vllm.SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=0, max_tokens=3, logprobs=0, seed=2**61,
                                 detokenize=False, flat_logprobs=True, output_kind=output_kind_delta(vllm))
    assert params.output_kind.name == "DELTA" and params.output_kind.value == RequestOutputKind.DELTA.value
    assert "llm_engine" in inspect.getsource(vllm.LLM.__init__)

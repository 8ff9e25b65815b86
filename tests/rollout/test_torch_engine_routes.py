"""The torch engine's route records (record_routes, routing replay): every response's record covers its prompt
and every response token but the last, and holds the experts the model's routers pick for them, compared with
one forward over the whole sequence (tiny Qwen3-MoE in float64, routers far from ties): in `generate`, in a
`fill` stream whose packs are rebuilt (re-prefilled) while rows run, and for a request carrying a prefix.
Wall budget: 10 s."""

import pytest
import torch

from flashdapo.models.moe import routers
from flashdapo.rollout.base import Request, SamplingParams
from flashdapo.rollout.torch_engine import TorchEngine
from tests.helpers.moe import one_thread, tiny_moe


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _routes_of(model, sequence: list[int]) -> torch.Tensor:
    """[len, layers, k] the routers' top-k (as sets: sorted) over one forward of `sequence`."""
    seen = []
    handles = [r.register_forward_hook(lambda _m, _i, out: seen.append(out[2].clone())) for r in routers(model)]
    with torch.no_grad():
        model(torch.tensor([sequence]))
    for h in handles:
        h.remove()
    return torch.stack(seen, dim=1).sort(-1).values


def _check(model, context: list[int], tokens: torch.Tensor, routes: torch.Tensor) -> None:
    sequence = [*context, *tokens.tolist()][:-1]
    assert routes.dtype == torch.uint8 and routes.shape == (len(sequence), 2, 2)
    assert torch.equal(routes.long().sort(-1).values, _routes_of(model, sequence))


def test_generate_records_every_fed_position():
    model = tiny_moe(seed=2)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, max_batch=3, record_routes=True)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11, 12]]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=4))
    assert len(out.routes) == 6
    for prompt, response, routes in zip(out.prompt_ids, out.response_ids, out.routes):
        _check(model, prompt.tolist(), response, routes)


def test_a_stream_with_rebuilt_packs_and_a_carried_prefix_records_the_whole_sequence():
    model = tiny_moe(seed=5)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, max_batch=2, record_routes=True)
    engine.open_stream(SamplingParams(max_new_tokens=9, seed=6))
    requests = [Request(0, (3, 4, 5), max_new_tokens=2), Request(1, (6, 7, 8, 9), (20, 21), max_new_tokens=7),
                Request(2, (10, 11), max_new_tokens=5)]
    engine.submit(requests)
    done = {}
    while engine.pending():
        done.update((c.key, c) for c in engine.step())
    engine.abort()
    assert sorted(done) == [0, 1, 2]
    for request in requests:
        completion = done[request.key]
        _check(model, [*request.prompt, *request.prefix], completion.tokens, completion.routes)


def test_without_recording_there_are_no_routes_and_a_dense_model_cannot_record():
    model = tiny_moe(seed=2)
    out = TorchEngine(model, eos_token_ids=[1], pad_token_id=0).generate([[3, 4]], SamplingParams(max_new_tokens=3))
    assert out.routes is None
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=20, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        TorchEngine(dense, eos_token_ids=[1], pad_token_id=0, record_routes=True)

"""Routing replay (flashdapo/models/moe/replay.py) on a tiny Qwen3-MoE (4 experts, top-2, 2 layers, float64):
replaying the model's own routes changes nothing (outputs and gradients bit for bit), replaying other routes
sends every recorded position to the recorded experts with transformers' gate weights on them and a gradient
into the routers, and the records are laid out exactly like the packed, padded and sequence-parallel
micro-batches' tokens. Wall budget: 10 s."""

import pytest
import torch

from flashdapo.errors import ConfigError
from flashdapo.models.moe import routers
from flashdapo.models.moe.replay import (
    NO_ROUTE,
    RouteReplay,
    install_route_replay,
    lay_out_routes,
    route_dtype,
)
from flashdapo.models.policy import make_token_batch
from tests.helpers.moe import one_thread, tiny_moe


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _own_routes(model, ids: torch.Tensor) -> torch.Tensor:
    """[positions, layers, k] the routers' own top-k for `ids` [1, T]."""
    seen = []
    handles = [r.register_forward_hook(lambda _m, _i, out: seen.append(out[2].clone())) for r in routers(model)]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return torch.stack(seen, dim=1)


def _chosen(model):
    """Hooks after the replay's: what each router finally hands its experts per forward: (layer, logits,
    weights, indices)."""
    seen = []
    handles = [r.register_forward_hook(lambda _m, _i, out, layer=layer: seen.append((layer, *out)))
               for layer, r in enumerate(routers(model))]
    return seen, handles


def test_replaying_its_own_routes_changes_neither_outputs_nor_gradients():
    ids = torch.randint(3, 50, (1, 11), generator=torch.Generator().manual_seed(0))
    plain, replayed = tiny_moe(seed=1), tiny_moe(seed=1)
    replay = RouteReplay(routers(replayed))
    replay.load(_own_routes(plain, ids))
    out = [m(ids).logits for m in (plain, replayed)]
    assert torch.equal(out[0], out[1])
    for logits in out:
        logits.square().sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), replayed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert replay.take_agreement() == (22, 22)  # 11 positions x 2 layers, all the router's own choice


@pytest.mark.parametrize("norm", [False, True])
def test_replayed_routes_are_the_recorded_experts_with_transformers_weights_and_train_the_router(norm):
    ids = torch.randint(3, 50, (1, 9), generator=torch.Generator().manual_seed(2))
    model = tiny_moe(seed=3, norm_topk_prob=norm)
    own = _own_routes(model, ids)
    recorded = own.clone()
    recorded[:, :, 0] = (own[:, :, 1] + 1) % 4  # another expert first, never the second one
    recorded[:, :, 1] = (recorded[:, :, 0] + 1) % 4
    recorded[4] = NO_ROUTE  # one position without a record: its router chooses for itself
    replay = RouteReplay(routers(model))
    replay.load(recorded)
    seen, handles = _chosen(model)
    model(ids).logits.square().sum().backward()
    for h in handles:
        h.remove()
    for layer, logits, weights, indices in seen:
        expected = recorded[:, layer].clone()
        expected[4] = own[4, layer]
        assert torch.equal(indices, expected)
        # transformers' Qwen3MoeTopKRouter on these experts: fp32 softmax, gathered, renormalized when norm_topk_prob
        probs = torch.softmax(logits.detach(), dim=-1, dtype=torch.float).gather(-1, expected)
        if norm:
            probs = probs / probs.sum(-1, keepdim=True)
        assert torch.equal(weights.detach(), probs.to(logits.dtype))
        assert weights.requires_grad
    for r in routers(model):
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    matched, total = replay.take_agreement()
    assert total == 16 and matched == 0  # 8 recorded positions x 2 layers, every one moved


def test_replayed_weights_follow_transformers_router_math():
    """On a position replayed at its own experts in another order the weights are the same (as a set)."""
    model = tiny_moe(seed=4)
    gate = routers(model)[0]
    hidden = torch.randn(5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    logits, weights, indices = gate(hidden)
    replay = RouteReplay([gate])
    replay.load(indices.flip(-1)[:, None])
    _, replayed_w, replayed_i = gate(hidden)
    assert torch.equal(replayed_i, indices.flip(-1))
    assert torch.allclose(replayed_w, weights.flip(-1), rtol=0, atol=1e-7)  # fp32 softmax, as transformers


def _coded_records(lengths: list[int]) -> list[torch.Tensor]:
    """Record i, position p = (i, p) in one layer of k=2: where it lands says where it came from."""
    return [torch.stack([torch.full((n,), i), torch.arange(n)], dim=-1)[:, None] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("packed,sp", [(True, 1), (False, 1), (True, 3)])
def test_records_are_laid_out_like_the_micro_batch_tokens(packed, sp):
    prompts = [torch.tensor([3, 4, 5]), torch.tensor([6, 7]), torch.tensor([8, 9, 10, 11])]
    responses = [torch.tensor([12, 13, 14]), torch.tensor([15]), torch.tensor([16, 17])]
    lengths = [len(p) + len(r) - 1 for p, r in zip(prompts, responses)]
    records = _coded_records(lengths)
    records[1] = None  # a response without a record
    shards = [make_token_batch(prompts, responses, torch.device("cpu"), packed, sp, rank, routes=records)
              for rank in range(sp)]
    for batch in shards:
        assert batch.routes.shape == (batch.input_ids.numel(), 1, 2)
    layout = torch.cat([b.routes for b in shards])[:, 0]
    ids = torch.cat([b.input_ids.reshape(-1) for b in shards])
    sequences = [torch.cat([p, r[:-1]]) for p, r in zip(prompts, responses)]
    expected = []
    width = max(lengths)
    for i, seq in enumerate(sequences):
        for pos in range(len(seq)):
            expected.append([i, pos] if records[i] is not None else [NO_ROUTE, NO_ROUTE])
        if not packed:
            expected += [[NO_ROUTE, NO_ROUTE]] * (width - len(seq))
    expected += [[NO_ROUTE, NO_ROUTE]] * (len(layout) - len(expected))  # the sequence-parallel filler
    assert layout.tolist() == expected
    # and the token at each recorded position is the one the record was made at
    flat = torch.cat([torch.cat([s, s.new_zeros(width - len(s))]) if not packed else s for s in sequences])
    assert torch.equal(ids[:len(flat)], flat)


def test_a_longer_record_is_cut_and_a_shorter_one_leaves_the_rest_free():
    records = [torch.ones(7, 2, 2, dtype=torch.uint8), torch.ones(2, 2, 2, dtype=torch.uint8)]
    layout = lay_out_routes(records, [5, 4], packed=True, width=9)
    assert layout.shape == (9, 2, 2)
    assert (layout[:5] == 1).all() and (layout[5:7] == 1).all() and (layout[7:] == NO_ROUTE).all()
    assert lay_out_routes([None, None], [3, 3], packed=False, width=3) is None


def test_route_dtype_is_the_narrowest_that_fits():
    assert route_dtype(4) == torch.uint8 and route_dtype(256) == torch.uint8
    assert route_dtype(257) == torch.int16 and route_dtype(40000) == torch.int32


def test_r3_on_a_dense_model_is_refused_in_one_line():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=20, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    with pytest.raises(ConfigError, match=r"algorithm.routing_replay=r3: the model \(qwen3\) is dense") as err:
        install_route_replay(dense, "r3")
    assert "\n" not in str(err.value)
    assert install_route_replay(dense, "off") is None


def test_records_with_a_row_per_decoder_layer_replay_the_sparse_layers_rows():
    """vLLM's routed_experts has a row per decoder layer, dense ones included (Qwen3-MoE's mlp_only_layers,
    DeepSeek-V3's first_k_dense_replace; DeepSeek-V3 itself takes no R3: its routers are not softmax top-k):
    a Qwen3-MoE whose layer 0 is dense loads them, replaying rows 1 and 2 on its two routers, as it loads the
    torch engine's one row per sparse layer; any other count is refused in one line."""
    ids = torch.randint(3, 50, (1, 10), generator=torch.Generator().manual_seed(4))
    plain, replayed = (tiny_moe(seed=5, num_hidden_layers=3, mlp_only_layers=[0]) for _ in range(2))
    replay = install_route_replay(replayed, "r3")
    assert len(replay.routers) == 2 and replay.sparse_layers == [1, 2] and replay.decoder_layers == 3
    own = _own_routes(plain, ids)  # [10, 2 sparse layers, 2]
    dense_row = torch.full((10, 1, 2), 3)  # whatever vLLM puts in a dense layer's row: not replayed
    per_decoder_layer = torch.cat([dense_row, own], dim=1)
    expected = plain(ids).logits
    for records in (per_decoder_layer, own):
        layout = lay_out_routes([records], [10], packed=True, width=10)
        replay.load(layout)
        assert torch.equal(replayed(ids).logits, expected)
        assert replay.take_agreement() == (20, 20)
    other = own.clone()
    other[:, :, 0] = (own[:, :, 1] + 1) % 4
    other[:, :, 1] = (other[:, :, 0] + 1) % 4
    replay.load(torch.cat([dense_row, other], dim=1))
    seen, handles = _chosen(replayed)
    replayed(ids)
    for h in handles:
        h.remove()
    assert [layer for layer, *_ in seen] == [0, 1]
    for layer, _logits, _weights, indices in seen:
        assert torch.equal(indices, other[:, layer])
    with pytest.raises(ValueError) as err:
        replay.load(torch.zeros(10, 4, 2, dtype=torch.long))
    assert str(err.value) == ("routing replay: the records hold 4 layers, the model has 2 sparse layers of 3 "
                              "decoder layers")

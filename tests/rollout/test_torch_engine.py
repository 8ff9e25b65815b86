"""TorchEngine on a tiny random Qwen2 (CPU, fp32): fields, stopping, seeds, filters, log-probs."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashdapo.kernels import token_logprobs
from flashdapo.rollout.base import SamplingParams
from flashdapo.rollout.torch_engine import TorchEngine, _inverse_cdf, left_pad, sample

VOCAB, EOS, PAD = 97, 3, 0
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]  # different lengths -> left padding


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,  # peakier than the default so the sampled tokens vary in probability
        pad_token_id=PAD,
    )
    return Qwen2ForCausalLM(config).float()


def with_eos_bias(model: Qwen2ForCausalLM, eos: int, bias: float) -> Qwen2ForCausalLM:
    """Give the LM head a bias that makes `eos` certain (bias > 0) or impossible (bias < 0)."""
    head = torch.nn.Linear(model.config.hidden_size, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[eos] = bias
    model.lm_head = head
    return model


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    return tiny_model()


def engine_for(model, eos=(EOS,), **kw) -> TorchEngine:
    return TorchEngine(model, eos_token_ids=list(eos), pad_token_id=PAD, device="cpu", **kw)


def reference_logprobs(model, prompt: torch.Tensor, response: torch.Tensor, temperature: float, top_k: int = -1):
    """Recompute the response's log-probs by one unpadded full forward, through the kernels' reference;
    with top_k, renormalized over the k most likely tokens (the distribution sampled from)."""
    full = torch.cat([prompt, response])[None]
    with torch.no_grad():
        hidden = model.model(input_ids=full).last_hidden_state[0]  # after the final norm
    start = len(prompt) - 1  # hidden state t predicts token t + 1
    h = hidden[start : start + len(response)]
    if top_k <= 0:
        return token_logprobs(h, model.lm_head.weight, response, temperature=temperature, impl="naive")
    z = (h.double() @ model.lm_head.weight.double().T) / temperature
    z = z.masked_fill(z < z.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    return torch.log_softmax(z, -1).gather(-1, response[:, None]).squeeze(-1).float()


def greedy_continuation(model, prompt: torch.Tensor, length: int) -> torch.Tensor:
    """Argmax continuation by repeated full forwards (no cache, no padding)."""
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(length):
            seq = torch.cat([seq, model(input_ids=seq[None]).logits[0, -1].argmax()[None]])
    return seq[len(prompt) :]


def test_left_pad():
    ids, mask, pos = left_pad([[1, 2, 3], [4]], pad_token_id=9)
    assert ids.tolist() == [[1, 2, 3], [9, 9, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_rollouts_fields(model):
    out = engine_for(model).generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=1))
    assert len(out) == 6
    assert out.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert out.group_ids.dtype == torch.long and out.truncated.dtype == torch.bool
    for i, g in enumerate(out.group_ids.tolist()):
        assert out.prompt_ids[i].tolist() == PROMPTS[g]
        assert out.response_ids[i].dtype == torch.long
        assert out.logprobs[i].dtype == torch.float32
        assert out.logprobs[i].shape == out.response_ids[i].shape
        assert (out.logprobs[i] <= 0).all()
        assert 1 <= len(out.response_ids[i]) <= 6
    assert out.prompt_ids[0] is out.prompt_ids[1]  # one tensor per prompt, shared by its group
    assert out.response_lengths.tolist() == [len(r) for r in out.response_ids]


def test_forced_eos_stops_at_once():
    eng = engine_for(with_eos_bias(tiny_model(), eos=EOS, bias=1e4), eos=(50, EOS))
    out = eng.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8))
    assert all(r.tolist() == [EOS] for r in out.response_ids)
    assert not out.truncated.any()
    assert all(lp.abs().max() < 1e-4 for lp in out.logprobs)  # EOS is certain: log p ~ 0


def test_never_eos_is_truncated():
    eng = engine_for(with_eos_bias(tiny_model(), eos=EOS, bias=-1e4))
    out = eng.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5))
    assert out.truncated.all()
    assert out.response_lengths.tolist() == [5] * 6
    assert not any((r == EOS).any() for r in out.response_ids)


def test_stops_at_first_eos(model):
    eos = list(range(20, 32))  # ~1/8 of the vocabulary: responses end at various lengths
    out = engine_for(model, eos=eos).generate(PROMPTS, SamplingParams(n=4, max_new_tokens=10, seed=3))
    lengths = out.response_lengths
    assert len(set(lengths.tolist())) > 1
    for resp, trunc in zip(out.response_ids, out.truncated.tolist(), strict=True):
        is_eos = torch.isin(resp, torch.tensor(eos))
        assert int(is_eos[:-1].sum()) == 0  # no EOS before the last token
        assert trunc == (not bool(is_eos[-1]))
        assert trunc <= (len(resp) == 10)


def test_same_seed_same_rollouts_other_seed_differs(model):
    eng = engine_for(model, max_batch=4)
    a = eng.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=7))
    b = eng.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=7))
    c = eng.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=8))
    for x, y in zip(a.response_ids + a.logprobs, b.response_ids + b.logprobs, strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a.truncated, b.truncated)
    assert any(not torch.equal(x, y) for x, y in zip(a.response_ids, c.response_ids, strict=True))


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6)])
def test_filters_reduce_to_argmax(model, filters):
    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=0.8, seed=5, **filters)
    out = engine_for(model, eos=(VOCAB + 1,)).generate(PROMPTS, sampling)  # an EOS that never comes
    for prompt, resp in zip(out.prompt_ids, out.response_ids, strict=True):
        assert torch.equal(resp, greedy_continuation(model, prompt, 6))


def test_sample_filters_unit():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 4000)
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample(logits, top_k=2, generator=gen)
    assert set(tokens.tolist()) == {1, 3}
    # The log-probs of the distribution drawn from: softmax renormalized over the survivors {1, 3}.
    survivors = torch.log_softmax(torch.tensor([3.0, 2.0]), -1)
    assert torch.allclose(logp, torch.where(tokens == 1, survivors[0], survivors[1]))
    # top_p: p = softmax([0, 3, 1, 2]) = [.03, .64, .09, .24]; 0.8 keeps tokens 1 and 3 (.64 < .8 <= .88).
    tokens, _ = sample(logits, top_p=0.8, generator=gen)
    assert set(tokens.tolist()) == {1, 3}
    tokens, _ = sample(logits, generator=gen)  # unfiltered: the frequencies follow softmax
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, -1), (0.7, 5)])
def test_logprobs_match_full_forward(model, temperature, top_k):
    """Left-padded cached decoding gives the unpadded forward's log_softmax(logits / T), renormalized over
    the top-k survivors when top-k is on."""
    sampling = SamplingParams(n=3, max_new_tokens=9, temperature=temperature, top_k=top_k, seed=11)
    out = engine_for(model).generate(PROMPTS, sampling)
    for prompt, resp, logp in zip(out.prompt_ids, out.response_ids, out.logprobs, strict=True):
        ref = reference_logprobs(model, prompt, resp, temperature, top_k)
        torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)
        if top_k > 0:  # renormalized: above the unfiltered log-probs
            assert (logp >= reference_logprobs(model, prompt, resp, temperature) - 1e-6).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_logprobs_match_full_forward():
    model = tiny_model().cuda()
    sampling = SamplingParams(n=2, max_new_tokens=9, temperature=0.7, top_k=5, seed=4)
    out = TorchEngine(model, [EOS], PAD).generate(PROMPTS, sampling)  # device from the parameters
    assert out.response_ids[0].device.type == "cpu"  # Rollouts always come back on the host
    for prompt, resp, logp in zip(out.prompt_ids, out.response_ids, out.logprobs, strict=True):
        ref = reference_logprobs(model, prompt.cuda(), resp.cuda(), sampling.temperature, sampling.top_k).cpu()
        torch.testing.assert_close(logp, ref, atol=1e-4, rtol=0)


def test_group_of_n_samples(model):
    out = engine_for(model).generate([PROMPTS[1]], SamplingParams(n=8, max_new_tokens=6, seed=2))
    assert out.group_ids.tolist() == [0] * 8
    assert len({tuple(r.tolist()) for r in out.response_ids}) > 1  # independent draws, not copies


def test_sub_batches_match_one_batch(model):
    sampling = SamplingParams(n=2, max_new_tokens=5, top_k=1)
    whole = engine_for(model).generate(PROMPTS, sampling)
    split = engine_for(model, max_batch=4).generate(PROMPTS, sampling)
    single = engine_for(model).generate(PROMPTS, sampling, max_batch=1)
    for a, b, c in zip(whole.response_ids, split.response_ids, single.response_ids, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    for a, c in zip(whole.logprobs, single.logprobs, strict=True):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=0)


def test_eval_mode_during_generation_and_restored(model):
    seen = []
    handle = model.register_forward_pre_hook(lambda mod, args: seen.append(mod.training))
    try:
        model.train()
        engine_for(model).generate(PROMPTS[:1], SamplingParams(max_new_tokens=3))
    finally:
        handle.remove()
    assert seen and not any(seen)
    assert model.training
    model.eval()


def test_rejects_bad_requests(model):
    eng = engine_for(model)
    with pytest.raises(ValueError):
        eng.generate(PROMPTS, SamplingParams(temperature=0.0))
    with pytest.raises(ValueError):
        eng.generate([[]], SamplingParams())
    assert len(eng.generate([], SamplingParams())) == 0


def _distributed_worker(rank: int, world: int, init_file: str) -> None:
    """One FSDP2 rank: fewer prompts on rank 1, so it must keep stepping (dummy batch) in lockstep."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)  # two ranks share the CPU cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        sharded, plain = tiny_model(), tiny_model()  # same seed: same weights
        mesh = init_device_mesh("cpu", (world,))
        for layer in sharded.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        calls = []
        sharded.register_forward_pre_hook(lambda mod, args: calls.append(1))
        prompts = PROMPTS if rank == 0 else PROMPTS[1:2]  # 2 sub-batches vs 1
        eos = list(range(20, 32))
        eng = TorchEngine(sharded, eos, PAD, process_group=dist.group.WORLD, max_batch=2)
        ref = TorchEngine(plain, eos, PAD, max_batch=2)
        greedy = SamplingParams(n=1, max_new_tokens=6, top_k=1)
        for sampling in (greedy, SamplingParams(n=2, max_new_tokens=6, seed=rank)):
            out, want = eng.generate(prompts, sampling), ref.generate(prompts, sampling)
            if sampling.top_k == 1:  # greedy: the sharded engine must reproduce the plain one
                assert all(
                    torch.equal(a, b) for a, b in zip(out.response_ids, want.response_ids, strict=True)
                )
                for a, b in zip(out.logprobs, want.logprobs, strict=True):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        counts = [None] * world
        dist.all_gather_object(counts, len(calls))
        assert counts[0] == counts[1], counts
        # The RolloutEngine contract: wake gathers the shards for the whole generation (never reading the
        # weight source: the engine samples from the policy module itself), sleep reshards them.
        from torch.distributed.tensor import DTensor

        def no_copy(dtype):
            raise AssertionError("the torch engine must not read the weight source")

        eng.wake(no_copy)
        assert not any(isinstance(p, DTensor) for p in sharded.parameters())
        out, want = eng.generate(prompts, greedy), ref.generate(prompts, greedy)
        assert all(torch.equal(a, b) for a, b in zip(out.response_ids, want.response_ids, strict=True))
        eng.sleep()
        assert all(isinstance(p, DTensor) for p in sharded.parameters())
        dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_fsdp2_ranks_stay_in_lockstep(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _distributed_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=False, start_method="spawn"
    )
    for _ in range(120):  # a deadlock fails the test instead of hanging it
        if ctx.join(timeout=1):
            return
    for p in ctx.processes:
        p.kill()
    pytest.fail("distributed generate did not finish within 120 s (ranks out of step?)")


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """float64 target distribution of one row: softmax(logits / T), top-k (ties kept), then top-p over the
    renormalized survivors (smallest most-likely prefix reaching top_p)."""
    z = logits.double() / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k > 0:
        keep &= z >= torch.sort(z, descending=True).values[top_k - 1]
    p = torch.where(keep, torch.softmax(z.masked_fill(~keep, float("-inf")), -1), 0.0)
    order = torch.argsort(p, descending=True)
    before = torch.cumsum(p[order], 0) - p[order]
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep).scatter(0, order, keep_sorted) & (p > 0)
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.0, 5, 1.0),
                                                     (1.3, -1, 0.8), (0.9, 7, 0.6)])
def test_sampler_distribution_chi_square(temperature, top_k, top_p):
    """Frequencies of 200k draws on a 13-token vocabulary match the float64 target (chi-square, p > 1e-4);
    filtered-out tokens are never drawn; the log-probs are those of the renormalized target."""
    gen = torch.Generator().manual_seed(1234 + top_k)
    logits = torch.randn(13, generator=gen) * 1.5
    draws = 200_000
    tokens, logp = sample(logits.expand(draws, -1), temperature, top_p, top_k, generator=gen)
    expected = _reference_probs(logits, temperature, top_k, top_p)
    counts = torch.bincount(tokens, minlength=13).double()
    assert counts[expected == 0].sum() == 0
    live = expected > 0
    stat = ((counts[live] - draws * expected[live]) ** 2 / (draws * expected[live])).sum()
    dof = int(live.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()
    assert p_value > 1e-4, (stat.item(), dof)
    torch.testing.assert_close(logp.double(), expected.log()[tokens], atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1e-6, 1e-40])
def test_a_temperature_below_vllms_threshold_decodes_greedily(temperature):
    logits = torch.randn(5, 37, generator=torch.Generator().manual_seed(3)) * 30
    tokens, logprobs = sample(logits, temperature=temperature)
    assert torch.equal(tokens, logits.argmax(dim=-1)) and torch.equal(logprobs, torch.zeros(5))


@pytest.mark.parametrize("vocab", [1536, 777])  # 6 blocks of 256; no power-of-two factor: padded to 4 blocks
def test_two_level_draw_chi_square(vocab):
    """The block-then-entry inverse CDF draws index i with probability w_i / sum(w) across blocks, and
    never an index of weight 0 (20 live entries spread over the blocks, the rest 0)."""
    gen = torch.Generator().manual_seed(vocab)
    live = torch.randperm(vocab, generator=gen)[:20]
    weights = torch.zeros(vocab)
    weights[live] = torch.rand(20, generator=gen) + 0.2
    draws = 20_000
    counts = torch.bincount(_inverse_cdf(weights.expand(draws, -1), gen), minlength=vocab).double()
    expected = weights.double() / weights.double().sum()
    assert counts[expected == 0].sum() == 0
    stat = ((counts[live] - draws * expected[live]) ** 2 / (draws * expected[live])).sum()
    assert torch.special.gammaincc(torch.tensor(19 / 2, dtype=torch.float64), stat / 2).item() > 1e-4, stat

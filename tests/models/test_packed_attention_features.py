"""The packed attention honours what a model's own attention computes beyond plain causal softmax: Gemma 2's
attention-logit softcap, GPT-OSS's attention sinks, sliding windows beside both, and eager attention itself.
For tiny float64 models at odd document lengths, the packed policy's per-token log-probs equal the padded
policy's and transformers' own eager forward of each sequence alone, to the noise of transformers' fp32
softmax; dropping the softcap or the sinks moves them by orders of magnitude more. Also: flash-attn gets
the softcap and is refused (one line, at start-up) for sinks; under sequence parallelism each rank gets its
heads' sinks; the toy trains with eager attention."""

import copy
import sys
import threading

import pytest
import torch

from flashdapo.distributed.mesh import DistEnv, shutdown
from flashdapo.errors import ConfigError
from flashdapo.models import packing, ulysses
from flashdapo.models.policy import PolicyModel, make_token_batch, per_token_split
from tests.helpers.attention_models import VOCAB, gemma2_softcapped, gpt_oss_with_sinks, qwen2_windowed
from tests.helpers.thread_ranks import ThreadGroup

CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, mesh=None)
LENGTHS = [(5, 6), (3, 9), (11, 1), (2, 12)]
"""(prompt, response): documents of 10, 11, 11 and 13 tokens, all longer than the window of 4. No padded row
is more than the window shorter than the longest: a padding query that sees no key makes HF's padded eager
attention NaN in float64 (Gemma 2 runs the softmax in fp32, where float64's mask minimum is -inf)."""
TOL = dict(rtol=1e-6, atol=1e-6)
"""The noise floor: transformers' eager attention of these models runs its softmax in fp32 (~1e-8 here)."""


def _sequences():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (p,), generator=g) for p, _ in LENGTHS]
    responses = [torch.randint(0, VOCAB, (r,), generator=g) for _, r in LENGTHS]
    return prompts, responses


def _reference(model, prompts, responses) -> list[torch.Tensor]:
    """transformers' own float64 forward of each sequence alone (its eager attention, its masks)."""
    with torch.no_grad():
        out = []
        for p, r in zip(prompts, responses):
            logits = model(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1:-1]
            out.append(torch.log_softmax(logits, dim=-1).gather(1, r[:, None]).squeeze(1))
        return out


def _policy_logprobs(model, impl: str, prompts, responses) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(packed, padded) per-token log-probs of the policy switched to packing; the padded micro-batch goes
    through the packed stand-in's unpacked path (the inner implementation, as the sampler's calls do)."""
    model.config._attn_implementation = impl
    policy = PolicyModel(model, impl, "naive", temperature=1.0)
    policy.set_layout(True, ENV)
    with torch.no_grad():
        packed = policy.token_batch(prompts, responses, CPU)
        padded = make_token_batch(prompts, responses, CPU, packed=False)
        return per_token_split(policy(packed)[0], packed), per_token_split(policy(padded)[0], padded)


def _assert_all_close(got: list[torch.Tensor], expected: list[torch.Tensor], what: str):
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g.double(), e, **TOL, msg=lambda m: f"{what}: {m}")


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("cap, impl, block", [(0.5, "sdpa", 256), (0.5, "eager", 3), (50.0, "sdpa", 3)])
def test_gemma2_softcap_packed_equals_padded_equals_transformers(monkeypatch, cap, impl, block):
    """Gemma 2 (softcap, a sliding layer with a window of 4 and a full layer, query_pre_attn_scalar scaling),
    also in query blocks of 3 rows (not dividing any document). SDPA takes no softcap: the packed path
    computes the scores, and the stand-in's unpacked calls run Gemma 2's eager attention."""
    monkeypatch.setattr(packing, "QUERY_BLOCK", block)
    model = gemma2_softcapped(cap)
    prompts, responses = _sequences()
    expected = _reference(copy.deepcopy(model), prompts, responses)
    packed, padded = _policy_logprobs(model, impl, prompts, responses)
    assert model.config._attn_implementation == "flashdapo_packed_eager"
    _assert_all_close(packed, expected, "packed")
    _assert_all_close(padded, expected, "padded")
    uncapped = copy.deepcopy(model)  # the tolerance is meaningful: without the cap the log-probs move far more
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert _max_diff(packed, _reference(uncapped, prompts, responses)) > 100 * TOL["atol"]


@pytest.mark.parametrize("block", [256, 3])
def test_gpt_oss_sinks_packed_equal_padded_equal_transformers(monkeypatch, block):
    """GPT-OSS (a tiny MoE: 4 experts, top-2; sinks per head; a sliding and a full layer)."""
    monkeypatch.setattr(packing, "QUERY_BLOCK", block)
    model = gpt_oss_with_sinks()
    prompts, responses = _sequences()
    expected = _reference(copy.deepcopy(model), prompts, responses)
    packed, padded = _policy_logprobs(model, "eager", prompts, responses)
    _assert_all_close(packed, expected, "packed")
    _assert_all_close(padded, expected, "padded")
    sinkless = copy.deepcopy(model)
    with torch.no_grad():
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))  # exp(-inf) = 0: the sinks dropped from every softmax
    sinkless.config._attn_implementation = "eager"
    assert _max_diff(packed, _policy_logprobs(sinkless, "eager", prompts, responses)[0]) > 1e4 * TOL["atol"]


def test_eager_qwen2_packed_padded_and_cached_sampling_equal_transformers():
    """Eager attention (which transformers does not register) on a plain Qwen2 with a sliding layer: packed,
    padded, and sampling with a KV cache through the packed stand-in all give transformers' own forward."""
    model = qwen2_windowed()
    prompts, responses = _sequences()
    reference = copy.deepcopy(model)
    expected = _reference(reference, prompts, responses)
    packed, padded = _policy_logprobs(model, "eager", prompts, responses)
    assert model.config._attn_implementation == "flashdapo_packed_eager"
    _assert_all_close(packed, expected, "packed")
    _assert_all_close(padded, expected, "padded")
    ids = torch.cat([prompts[3], responses[3]])[None]  # 14 tokens: the cache outgrows the window
    with torch.no_grad():
        full = reference(input_ids=ids).logits
        out = model(input_ids=ids[:, :5], use_cache=True)
        steps = [out.logits]
        for t in range(5, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    # float32: the cached path multiplies other shapes than the full forward, so the last bits differ with the
    # CPU's kernels (1.7e-8 on some); a cache that ignored the window would be off by ~0.1 (the control below).
    cached = torch.cat(steps, dim=1)
    torch.testing.assert_close(cached, full, rtol=0, atol=2e-7)
    unwindowed = copy.deepcopy(reference)
    for layer in unwindowed.model.layers:
        layer.self_attn.sliding_window = None
    unwindowed.config.layer_types = ["full_attention"] * len(unwindowed.model.layers)
    with torch.no_grad():
        assert (unwindowed(input_ids=ids).logits - cached).abs().max() > 1e-2


def _dense_reference(query, key, value, lengths, scale, window, softcap, sinks):
    """The whole row at once, [T, T] (what the packed path must never build): document, causal and window
    mask, c * tanh(s / c), the sinks as an extra softmax column."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    i, j = torch.arange(len(doc))[:, None], torch.arange(len(doc))[None, :]
    visible = (doc[:, None] == doc[None, :]) & (j <= i) & (pos[None, :] > pos[:, None] - window)
    key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))
    scores = softcap * torch.tanh(query @ key.transpose(2, 3) * scale / softcap)
    scores = torch.cat([scores.masked_fill(~visible, float("-inf")), sinks.reshape(1, -1, 1, 1).expand(
        1, -1, len(doc), 1)], dim=-1)
    return (scores.softmax(-1)[..., :-1] @ value).transpose(1, 2)


@pytest.mark.parametrize("block", [256, 3])
def test_explicit_scores_and_their_gradients_equal_the_whole_row_formula(monkeypatch, block):
    """The per-document explicit path (softcap, sinks, window; blocks of 3 rows checkpointed under autograd)
    against the formula on the whole row: output and gradients of query, key, value and sinks, float64."""
    monkeypatch.setattr(packing, "QUERY_BLOCK", block)
    g = torch.Generator().manual_seed(7)
    lengths = [9, 1, 14, 5]
    query = (torch.randn(1, 4, 29, 8, generator=g, dtype=torch.float64) * 2).requires_grad_()
    key, value = (torch.randn(1, 2, 29, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64).requires_grad_()
    weights = torch.randn(1, 29, 4, 8, generator=g, dtype=torch.float64)
    offsets = packing.DocumentBounds.from_lengths(lengths, CPU).offsets
    got = packing.document_attention(query, key, value, offsets, 0.3, 4, 0.5, sinks)
    expected = _dense_reference(query, key, value, lengths, 0.3, 4, 0.5, sinks)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    inputs = (query, key, value, sinks)
    for a, b in zip(torch.autograd.grad((got * weights).sum(), inputs),
                    torch.autograd.grad((expected * weights).sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_flash_attn_with_sinks_is_refused_at_start_up_in_one_line():
    model = gpt_oss_with_sinks()
    model.config._attn_implementation = "flash_attention_2"
    policy = PolicyModel(model, "flash_attention_2", "naive", temperature=1.0)
    with pytest.raises(ConfigError) as err:
        policy.set_layout(True, ENV)
    message = str(err.value)
    assert "\n" not in message and message.startswith("model.attn_implementation flash_attention_2: gpt_oss's "
                                                      "attention sinks are not supported by flash-attn's varlen")


def test_flash_attn_varlen_gets_the_softcap_and_the_window(monkeypatch):
    """The flash path hands the softcap to the kernel (flash-attn >= 2.6 takes `softcap`); a recording
    stand-in computes what the kernel would, by the per-document path."""
    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_size=(-1, -1), softcap=0.0):
        calls.append({"window_size": window_size, "softcap": softcap, "causal": causal})
        window = None if window_size[0] < 0 else window_size[0] + 1
        out = packing.document_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), cu_q.tolist(),
                                         softmax_scale, window, softcap or None)
        return out[0]

    monkeypatch.setitem(sys.modules, "flash_attn",
                        type("flash_attn", (), {"flash_attn_varlen_func": staticmethod(varlen)}))
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 17, 8, generator=g, dtype=torch.float64) * 3
    key, value = (torch.randn(1, 2, 17, 8, generator=g, dtype=torch.float64) for _ in range(2))
    bounds = packing.DocumentBounds.from_lengths([9, 8], CPU)
    out = packing._attend_packed(query, key, value, "flash_attention_2", bounds, None, scaling=0.3,
                                 sliding_window=4, softcap=0.5)
    assert calls == [{"window_size": (3, 0), "softcap": 0.5, "causal": True}]
    uncapped = packing.document_attention(query, key, value, bounds.offsets, 0.3, 4)
    assert (out - uncapped).abs().max() > 0.1


@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_gives_each_rank_its_heads_sinks(monkeypatch, sp):
    """Under sequence parallelism (sp ranks simulated by threads, both all-to-alls and the KV-head repeat
    real) with sinks, a softcap and a window, each rank's output shard is that of the whole row in one
    process, and the sinks' gradient summed over ranks is one process's."""
    group = ThreadGroup(sp)
    rank_of = {}
    monkeypatch.setattr(ulysses.dist, "get_world_size", lambda g: sp)
    monkeypatch.setattr(ulysses.dist, "get_rank", lambda g: rank_of[threading.get_ident()])
    monkeypatch.setattr(ulysses, "_all_to_all",
                        lambda chunks, g: group.all_to_all(chunks, rank_of[threading.get_ident()]))
    g = torch.Generator().manual_seed(sp)
    heads, total = 8, 24
    query = torch.randn(1, heads, total, 4, generator=g, dtype=torch.float64) * 3
    key, value = (torch.randn(1, 2, total, 4, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(heads, generator=g, dtype=torch.float64).requires_grad_()
    bounds = packing.DocumentBounds.from_lengths([5, 13, 1, 5], CPU)
    weights = torch.randn(1, total, heads, 4, generator=g, dtype=torch.float64)
    expected = packing.document_attention(query, key, value, bounds.offsets, 0.4, 4, 0.5, sinks)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), sinks)
    shards, copies = {}, [sinks.detach().clone().requires_grad_() for _ in range(sp)]  # each rank's parameter

    def rank(r: int):
        rank_of[threading.get_ident()] = r
        a, b = ulysses.shard_bounds(total, sp, r)
        shards[r] = packing._attend_packed(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], "eager", bounds,
                                           object(), scaling=0.4, sliding_window=4, softcap=0.5, s_aux=copies[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(sp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat([shards[r] for r in range(sp)], dim=1), expected, rtol=1e-12, atol=1e-12)
    # The threads' graphs are one graph (the simulated all-to-alls pass tensors): one backward of every rank's
    # loss; each rank's copy gets its heads' gradient only, and their sum (FSDP2's reduction) is one process's.
    loss = sum((shards[r] * weights[:, slice(*ulysses.shard_bounds(total, sp, r))]).sum() for r in range(sp))
    grads = torch.autograd.grad(loss, copies)
    chunk = heads // sp
    for r, grad in enumerate(grads):
        assert not grad[:r * chunk].any() and not grad[(r + 1) * chunk:].any(), r
    torch.testing.assert_close(sum(grads), expected_grad, rtol=1e-12, atol=1e-12)


def test_the_toy_trains_two_steps_with_eager_attention(tmp_path):
    """`--model.attn-implementation eager` on the built-in toy: warm-up, rollouts with a KV cache, packed
    old log-probs and updates (it failed with KeyError: 'eager' before)."""
    from flashdapo.trainer.loop import train_step
    from flashdapo.trainer.setup import setup_run
    from tests.helpers.runs import tiny_config

    cfg = tiny_config(tmp_path / "run", model={"attn_implementation": "eager"},
                      trainer={"val_every": 0, "val_before_train": False}, logging={"plot": False})
    run = setup_run(cfg)
    try:
        assert run.policy.config._attn_implementation == "flashdapo_packed_eager" and run.policy.packed_layout
        metrics = [train_step(run, step) for step in (1, 2)]
    finally:
        shutdown()
    assert metrics[0]["actor/grad_norm"] > 0 and all(m["actor/grad_norm"] == m["actor/grad_norm"] for m in metrics)


@pytest.mark.distributed
@pytest.mark.slow
def test_sinks_and_softcap_under_two_sequence_parallel_ranks(tmp_path):
    """2 gloo ranks at sp = 2 (tests/models/scripts/packed_attention_features.py): GPT-OSS's sinks and Gemma 2's
    softcap through both all-to-alls give one process running each sequence alone with transformers' eager
    attention: the log-probs and every gradient (the sinks' included, each rank holding its heads' share) to the noise floor."""
    from tests.helpers.runs import ROOT, torchrun

    torchrun(2, str(ROOT / "tests" / "models" / "scripts" / "packed_attention_features.py"), str(tmp_path))
    results = torch.load(tmp_path / "results.pt")
    for name in ("gpt_oss", "gemma2"):
        (logp, grads), (ref_logp, ref_grads) = results[name]["sp"], results[name]["alone"]
        torch.testing.assert_close(logp, ref_logp, **TOL, msg=lambda m, name=name: f"{name}: {m}")
        assert grads.keys() == ref_grads.keys()
        for n in ref_grads:
            assert (grads[n] - ref_grads[n]).norm() <= 1e-6 * ref_grads[n].norm(), (name, n)
    sinks = [n for n in results["gpt_oss"]["alone"][1] if n.endswith("sinks")]
    assert len(sinks) == 2 and all(results["gpt_oss"]["alone"][1][n].abs().min() > 0 for n in sinks)

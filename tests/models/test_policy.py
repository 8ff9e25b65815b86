"""The policy's token batches: per-token log-probs equal those of separate, unpadded forwards."""

import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from flashdapo.kernels import token_logprobs
from flashdapo.models.policy import PolicyModel, make_token_batch, per_token_split

FAMILIES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM)}


def _model(family: str = "qwen2", **config):
    torch.manual_seed(0)
    config_cls, model_cls = FAMILIES[family]
    cfg = config_cls(**{"vocab_size": 61, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, **config})
    return model_cls(cfg).eval()


def test_padded_batch_logprobs_equal_separate_forwards():
    model = _model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 61, (n,), generator=g) for n in (5, 1, 9)]
    responses = [torch.randint(0, 61, (n,), generator=g) for n in (4, 7, 1)]
    policy = PolicyModel(model, "sdpa", "naive", temperature=0.7)
    with torch.no_grad():
        logp, _ = policy(policy.token_batch(prompts, responses, torch.device("cpu")))
        batch = make_token_batch(prompts, responses, torch.device("cpu"), packed=False)
        got = per_token_split(logp, batch)
        for p, r, lp in zip(prompts, responses, got):
            ids = torch.cat([p, r])[None]
            hidden = model.model(input_ids=ids).last_hidden_state[0, len(p) - 1:-1]
            expected = token_logprobs(hidden, model.lm_head.weight, r, temperature=0.7, impl="naive")
            torch.testing.assert_close(lp, expected, atol=1e-5, rtol=1e-5)


def test_packed_layout_indices():
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    responses = [torch.tensor([5, 6]), torch.tensor([7, 8, 9])]
    batch = make_token_batch(prompts, responses, torch.device("cpu"), packed=True)
    assert batch.input_ids.tolist() == [[1, 2, 3, 5, 4, 7, 8]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert batch.predict_index.tolist() == [2, 3, 4, 5, 6] and batch.targets.tolist() == [5, 6, 7, 8, 9]
    padded = make_token_batch(prompts, responses, torch.device("cpu"), packed=False)
    assert padded.input_ids.tolist() == [[1, 2, 3, 5], [4, 7, 8, 0]]
    assert padded.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert padded.predict_index.tolist() == [2, 3, 4, 5, 6]


def test_padded_micro_batches_respect_rows_times_longest():
    from flashdapo.trainer.batch import plan_micro_batches

    counts = [30, 5, 5, 5, 29, 12, 3, 3]
    bins = plan_micro_batches(counts, budget=60, padded=True)
    assert sorted(i for b in bins for i in b) == list(range(len(counts)))
    for b in bins:
        assert len(b) * max(counts[i] for i in b) <= 60 or len(b) == 1
    packed = plan_micro_batches(counts, budget=60, padded=False)
    assert sorted(i for b in packed for i in b) == list(range(len(counts)))
    assert all(sum(counts[i] for i in b) <= 60 for b in packed)


def _packed_policy(model, kernel="naive", attn="sdpa"):
    """A PolicyModel laid out packed (as parallelize sets it), with no process group."""
    from types import SimpleNamespace

    policy = PolicyModel(model, attn, kernel, temperature=0.7)
    policy.set_layout(True, SimpleNamespace(sequence_parallel=1, sp_group=None, sp_rank=0))
    return policy


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # per-layer-type masks (Qwen2) and a single one (Llama)
def test_packed_equals_padded_logprobs_and_gradients(family):
    """Very different lengths (1 to 200 tokens) in one micro-batch: the packed row with attention per sequence
    gives the padded layout's log-probs and gradients (and the model still samples as plain SDPA)."""
    g = torch.Generator().manual_seed(2)
    lengths = [(7, 200), (1, 1), (30, 3), (2, 90), (12, 41)]
    prompts = [torch.randint(0, 61, (p,), generator=g) for p, _ in lengths]
    responses = [torch.randint(0, 61, (r,), generator=g) for _, r in lengths]
    results = {}
    for name in ("padded", "packed"):
        model = _model(family).train()
        policy = PolicyModel(model, "sdpa", "naive", temperature=0.7) if name == "padded" else _packed_policy(model)
        batch = policy.token_batch(prompts, responses, torch.device("cpu"))
        assert (batch.bounds is not None) == (name == "packed") and batch.input_ids.shape[0] == (
            1 if name == "packed" else len(lengths))
        logp, _ = policy(batch)
        weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(3))
        (logp * weights).sum().backward()
        results[name] = logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    (lp_pad, grad_pad), (lp_pack, grad_pack) = results["padded"], results["packed"]
    torch.testing.assert_close(lp_pack, lp_pad, atol=1e-5, rtol=1e-5)
    for n in grad_pad:
        torch.testing.assert_close(grad_pack[n], grad_pad[n], atol=1e-5, rtol=1e-4, msg=n)
    assert model.config._attn_implementation == "flashdapo_packed_sdpa"
    ids = torch.randint(0, 61, (2, 9), generator=g)
    with torch.no_grad():  # unpacked calls (the rollout engine's) are plain SDPA
        torch.testing.assert_close(model(input_ids=ids).logits, _model(family)(input_ids=ids).logits)


def test_sequence_parallel_shards_hold_every_response_token_once():
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    responses = [torch.tensor([5, 6]), torch.tensor([7, 8, 9, 10, 11, 12])]
    shards = [make_token_batch(prompts, responses, torch.device("cpu"), packed=True, sp=3, sp_rank=r) for r in range(3)]
    # Row: 3 + 1 prompt, 1 + 5 response inputs = 10 tokens, a filler of 2 -> 12, 4 per rank.
    assert [s.input_ids.tolist() for s in shards] == [[[1, 2, 3, 5]], [[4, 7, 8, 9]], [[10, 11, 0, 0]]]
    assert [s.position_ids.tolist() for s in shards] == [[[0, 1, 2, 3]], [[0, 1, 2, 3]], [[4, 5, 0, 1]]]
    assert all(s.bounds.offsets == (0, 4, 10, 12) and s.bounds.longest == 6 for s in shards)
    assert all(s.bounds.cu_seqlens.tolist() == [0, 4, 10, 12] and s.bounds.cu_seqlens.dtype == torch.int32
               for s in shards)
    held = torch.cat([s.held for s in shards])
    assert held.tolist() == list(range(8))  # each of the 8 response tokens on exactly one rank
    assert torch.cat([s.targets for s in shards]).tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert [s.predict_index.tolist() for s in shards] == [[2, 3], [0, 1, 2, 3], [0, 1]]


def test_sequence_parallel_head_rule():
    """Query heads must divide by sp; KV heads must divide by sp or divide it (then they are repeated)."""
    from flashdapo.config import preset
    from flashdapo.errors import user_error_line
    from flashdapo.models.ulysses import check_heads

    check_heads(40, 8, 8)  # Qwen2.5-32B at the release's sp=8, which its preset sets
    assert preset("qwen2.5-32b-dapo").trainer.sequence_parallel == 8
    check_heads(32, 4, 8)  # Qwen3-30B-A3B at sp=8: each KV head twice
    check_heads(16, 2, 4)  # Qwen2.5-3B at sp=4
    check_heads(4, 1, 4)
    for heads, kv_heads, sp in ((4, 2, 8), (6, 3, 2), (40, 8, 16), (28, 4, 8)):
        with pytest.raises(Exception) as err:
            check_heads(heads, kv_heads, sp)
        line = user_error_line(err.value)
        assert line is not None and "\n" not in line, line
        assert f"{heads} query heads" in line and f"{kv_heads} key/value heads" in line and "divide" in line, line
    with pytest.raises(Exception) as err:
        check_heads(6, 3, 2)
    assert "choose one of 1, 3, 6" in user_error_line(err.value)


def test_sequence_parallel_checks_every_kind_of_attention_layer():
    """Gemma 4's full-attention layers carry key/value heads of their own (num_global_key_value_heads, in the
    config's per-layer values): sp must fit them too, in the trainer and in `flashdapo plan` alike."""
    from transformers import Gemma4TextConfig

    from flashdapo.errors import user_error_line
    from flashdapo.models.ulysses import check_layer_heads, layer_heads

    config = Gemma4TextConfig(num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4,
                              num_global_key_value_heads=3, attention_k_eq_v=True)
    assert layer_heads(config) == [(12, 3), (12, 4)]
    check_layer_heads(layer_heads(config), 1)
    check_layer_heads(layer_heads(config), 12)  # 4 and 3 key/value heads both divide 12
    with pytest.raises(Exception) as err:
        check_layer_heads(layer_heads(config), 2)  # the sliding layers' 4 fit, the full layers' 3 do not
    line = user_error_line(err.value)
    assert "12 query heads and 3 key/value heads (2 kinds of attention layer: 12/3, 12/4" in line, line
    assert "choose one of 1, 12" in line, line
    assert layer_heads(Gemma4TextConfig(num_hidden_layers=4, num_key_value_heads=4)) == [(8, 4)]  # no override


def _logprobs_and_grads(policy, prompts, responses):
    """Per-token log-probs of one micro-batch and the gradients of a fixed weighted sum of them (float64)."""
    logp, _ = policy(policy.token_batch(prompts, responses, torch.device("cpu")))
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (logp.double() * weights).sum().backward()
    return logp.detach().double(), {n: p.grad.double() for n, p in policy.hf.named_parameters()}


def _batch(lengths, seed=2):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randint(0, 61, (p,), generator=g) for p, _ in lengths],
            [torch.randint(0, 61, (r,), generator=g) for _, r in lengths])


# Longer and shorter than the window of 6, and exactly 2 windows long (7 + 5 tokens).
WINDOWED = [(7, 40), (1, 1), (2, 3), (7, 6), (3, 25)]
SLIDING = {"qwen2": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},  # layer 1 slides
           "mistral": {"sliding_window": 6}}  # every layer slides


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_packed_equals_padded(family):
    """Sliding-window layers attend to the last 6 tokens in packed rows as HF's padded masks have them: the
    same log-probs and gradients (float64), where full causal attention differs by ~1e-1."""
    prompts, responses = _batch(WINDOWED)
    padded = PolicyModel(_model(family, **SLIDING[family]).double().train(), "sdpa", "naive", temperature=0.7)
    lp_pad, grad_pad = _logprobs_and_grads(padded, prompts, responses)
    lp_pack, grad_pack = _logprobs_and_grads(_packed_policy(_model(family, **SLIDING[family]).double().train()),
                                             prompts, responses)
    torch.testing.assert_close(lp_pack, lp_pad, rtol=1e-12, atol=1e-12)
    for n in grad_pad:
        torch.testing.assert_close(grad_pack[n], grad_pad[n], rtol=1e-10, atol=1e-12, msg=n)
    full = PolicyModel(_model(family).double().train(), "sdpa", "naive", temperature=0.7)
    assert (_logprobs_and_grads(full, prompts, responses)[0] - lp_pad).abs().max() > 1e-2  # the window matters


def test_llama_packed_rows_build_no_mask(monkeypatch):
    """A Llama (one mask for all layers, no layer types) on a packed row builds no [T, T] mask: its mask
    builder is not called and every layer's attention gets an empty prepared mask; padded rows still get
    theirs."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = _model("llama")
    policy = _packed_policy(model)
    name = model.config._attn_implementation
    built, seen = [], []
    mask_builder, attention = ALL_MASK_ATTENTION_FUNCTIONS[name], ALL_ATTENTION_FUNCTIONS[name]

    def building(*args, **kwargs):
        built.append(mask_builder(*args, **kwargs))
        return built[-1]

    def attending(module, query, key, value, mask, **kwargs):
        seen.append(mask)
        return attention(module, query, key, value, mask, **kwargs)

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, building)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name, attending)
    prompts, responses = _batch([(7, 200), (1, 1), (30, 3)])
    with torch.no_grad():
        policy(policy.token_batch(prompts, responses, torch.device("cpu")))
        assert built == [] and len(seen) == 2 and all(m is None or m.numel() == 0 for m in seen), built
        ids = torch.randint(0, 61, (2, 9))
        model(input_ids=ids, attention_mask=torch.tensor([[1] * 9, [0] * 3 + [1] * 6]))  # padded: a mask
    assert len(built) == 1 and built[0].shape == (2, 1, 9, 9)


FLASH_CASES = {"qwen2-window-kv1": ("qwen2", {"num_key_value_heads": 1, **SLIDING["qwen2"]}),
               "llama": ("llama", {})}


@pytest.mark.parametrize("case", sorted(FLASH_CASES))
def test_flash_attention_path_through_stand_in(case, monkeypatch):
    """The packed flash-attn path (flash_attn_varlen_func, here the CPU stand-in that checks flash-attn's
    input contract) on a bf16 model: int32 boundaries on the device made once per micro-batch (the same
    tensor in every layer), the window as window_size, and log-probs and gradients as close to the float64
    reference (padded rows, SDPA, the same weights) as HF's own padded SDPA in bf16 is."""
    from tests.trainer.flash_stand_in import install

    stand_in = install(monkeypatch)
    family, config = FLASH_CASES[case]
    prompts, responses = _batch(WINDOWED)
    bf16 = _model(family, **{**config, "hidden_size": 64, "intermediate_size": 128}).to(torch.bfloat16).train()
    reference, plain = (_logprobs_and_grads(PolicyModel(model, "sdpa", "naive", 0.7), prompts, responses)
                        for model in (copy.deepcopy(bf16).double(), copy.deepcopy(bf16)))
    bf16.config._attn_implementation = "flash_attention_2"
    flash = _logprobs_and_grads(_packed_policy(bf16, attn="flash_attention_2"), prompts, responses)
    longest = max(p + r - 1 for p, r in WINDOWED)  # prompt + response but its last token
    assert len(stand_in.calls) == 2 and all(c.max_seqlen == longest for c in stand_in.calls)
    assert [c.window_size for c in stand_in.calls] == ([(-1, -1), (5, 0)] if family == "qwen2" else [(-1, -1)] * 2)
    assert stand_in.calls[0].cu_seqlens is stand_in.calls[1].cu_seqlens  # one device copy per micro-batch
    err, bf16_err = _error(flash, reference), _error(plain, reference)
    assert err[0] <= 2 * bf16_err[0] and err[1] <= 2 * bf16_err[1], (err, bf16_err)


def _error(got, reference):
    """(max |log-prob error|, the largest relative gradient error over the parameters)."""
    (lp, grads), (ref_lp, ref_grads) = got, reference
    return (lp - ref_lp).abs().max().item(), max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item()
                                                 for n in ref_grads)

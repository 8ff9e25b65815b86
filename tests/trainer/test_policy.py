"""The policy's token batches: per-token log-probs equal those of separate, unpadded forwards."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from flashdapo.kernels import token_logprobs
from flashdapo.trainer.policy import PolicyModel, make_token_batch, per_token_split


def _model(family: str = "qwen2"):
    torch.manual_seed(0)
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = config_cls(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256)
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


def _packed_policy(model, kernel="naive"):
    """A PolicyModel laid out packed (as parallelize sets it), with no process group."""
    from types import SimpleNamespace

    policy = PolicyModel(model, "sdpa", kernel, temperature=0.7)
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
        assert (batch.cu_seqlens is not None) == (name == "packed") and batch.input_ids.shape[0] == (
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
    assert all(s.cu_seqlens.tolist() == [0, 4, 10, 12] for s in shards)
    held = torch.cat([s.held for s in shards])
    assert held.tolist() == list(range(8))  # each of the 8 response tokens on exactly one rank
    assert torch.cat([s.targets for s in shards]).tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert [s.predict_index.tolist() for s in shards] == [[2, 3], [0, 1, 2, 3], [0, 1]]


def test_sequence_parallel_needs_heads_divisible():
    from flashdapo.config import preset
    from flashdapo.errors import user_error_line
    from flashdapo.trainer.ulysses import check_heads

    check_heads(40, 8, 8)  # Qwen2.5-32B at the release's sp=8, which its preset sets
    assert preset("qwen2.5-32b-dapo").trainer.sequence_parallel == 8
    with pytest.raises(Exception) as err:
        check_heads(4, 2, 4)  # the toy preset's heads at sp=4
    line = user_error_line(err.value)
    assert line is not None and "\n" not in line and "4 query heads" in line and "2 key/value heads" in line

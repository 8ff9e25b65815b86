"""The policy's token batches: per-token log-probs equal those of separate, unpadded forwards."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashdapo.kernels import token_logprobs
from flashdapo.trainer.policy import PolicyModel, make_token_batch, per_token_split


def _model():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).eval()


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

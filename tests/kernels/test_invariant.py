"""Batch-invariant building blocks (kernels/invariant.py): each equals a float64 reference, and gives a row the
same bits whatever rows share the call: a linear's row alone or among hundreds, a query's attention in a
decode step over a left-padded cache or inside a packed row of other documents, fp32 and bf16."""

import pytest
import torch

from flashdapo.kernels.invariant import (
    TILE,
    attention_extents,
    gemm_is_row_invariant,
    invariant_attention,
    invariant_linear,
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_linear_equals_float64_and_a_row_alone_equals_it_among_others(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(301, 72, generator=gen).to(dtype)
    w, bias = torch.randn(88, 72, generator=gen).to(dtype), torch.randn(88, generator=gen).to(dtype)
    full = invariant_linear(x, w, bias)
    reference = x.double() @ w.double().t() + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(full.double(), reference, rtol=tol, atol=tol)
    for start, size in [(0, 1), (5, 2), (17, 15), (40, 16), (100, 33), (299, 2)]:
        part = invariant_linear(x[start:start + size], w, bias)
        assert torch.equal(part, full[start:start + size]), (start, size)
    batched = invariant_linear(x[:30].view(3, 10, 72), w, bias)  # any leading shape: rows of a flat view
    assert torch.equal(batched.view(30, 88), full[:30])
    assert gemm_is_row_invariant(dtype)


def test_the_linears_gradients_are_the_plain_matmuls():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(19, 24, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(10, 24, dtype=torch.float64, generator=gen, requires_grad=True)
    up = torch.randn(19, 10, dtype=torch.float64, generator=gen)
    gx, gw = torch.autograd.grad((invariant_linear(x, w) * up).sum(), (x, w))
    torch.testing.assert_close(gx, up @ w, rtol=0, atol=1e-12)
    torch.testing.assert_close(gw, up.t() @ x, rtol=0, atol=1e-12)


def _causal_reference(q, k, v, scaling):
    """float64 softmax attention of one document, causal: q [H, L, D], k and v [Hkv, L, D] -> [L, H, D]."""
    group = q.shape[0] // k.shape[0]
    k, v = (t.double().repeat_interleave(group, 0) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scaling
    length = q.shape[1]
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def _docs(lengths, heads, kv_heads, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(h, n, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
            for n in lengths]


def _packed(docs):
    """One packed row of the documents: q [1, H, T, D], k, v [1, Hkv, T, D], each query's (first, count)."""
    q, k, v = (torch.cat([d[i] for d in docs], 1)[None] for i in range(3))
    first, count, at = [], [], 0
    for d in docs:
        n = d[0].shape[1]
        first += [at] * n
        count += list(range(1, n + 1))
        at += n
    return q, k, v, torch.tensor([first]), torch.tensor([count])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_attention_equals_float64_per_document(dtype, heads, kv_heads):
    lengths = [1, 7, 16, 17, 40, 3]  # within a block, a block exactly, across blocks
    docs = _docs(lengths, heads, kv_heads, 12, dtype, seed=2)
    q, k, v, first, count = _packed(docs)
    out = invariant_attention(q, k, v, first, count, scaling=12 ** -0.5)
    assert out.shape == (1, sum(lengths), heads, 12) and out.dtype == dtype
    at, tol = 0, (2e-6 if dtype == torch.float32 else 2e-2)
    for d, n in zip(docs, lengths):
        expected = _causal_reference(*d, 12 ** -0.5)
        torch.testing.assert_close(out[0, at:at + n].double(), expected, rtol=tol, atol=tol)
        at += n


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_step_over_a_padded_cache_equals_the_packed_forward_bit_for_bit(dtype):
    """Each document's every position, computed as a rollout engine does (one query over a left-padded KV
    cache shared with other rows of other lengths, in a cache longer than any row) equals the same position
    in a packed row of all the documents (the trainer's forward)."""
    heads, kv_heads, dim = 4, 2, 16
    lengths = [5, 23, 16, 33, 2]
    docs = _docs(lengths, heads, kv_heads, dim, dtype, seed=3)
    q, k, v, first, count = _packed(docs)
    packed = invariant_attention(q, k, v, first, count, scaling=0.25)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    slots = max(lengths) + 5  # a static cache: more slots than any row fills
    for step in range(max(lengths)):
        rows = [i for i, n in enumerate(lengths) if step < n]  # rows still decoding at this step
        pad = [slots - 1 - step - 3 * r for r in range(len(rows))]  # each row left-padded differently
        pad = [max(p, 0) for p in pad]
        cache_k = torch.zeros(len(rows), kv_heads, slots + 3 * len(rows), dim, dtype=dtype)
        cache_v = torch.zeros_like(cache_k)
        query = torch.zeros(len(rows), heads, 1, dim, dtype=dtype)
        for r, i in enumerate(rows):
            cache_k[r, :, pad[r]:pad[r] + step + 1] = docs[i][1][:, :step + 1]
            cache_v[r, :, pad[r]:pad[r] + step + 1] = docs[i][2][:, :step + 1]
            query[r, :, 0] = docs[i][0][:, step]
        allowed = torch.zeros(len(rows), 1, cache_k.shape[2], dtype=torch.bool)
        for r in range(len(rows)):
            allowed[r, 0, pad[r]:pad[r] + step + 1] = True
        f, c = attention_extents(allowed)
        out = invariant_attention(query, cache_k, cache_v, f, c, scaling=0.25)
        for r, i in enumerate(rows):
            assert torch.equal(out[r, 0], packed[0, starts[i] + step]), (dtype, i, step)


def test_without_the_anchored_blocks_a_position_differs_between_decode_and_the_packed_forward():
    """The control: torch's own attention (SDPA) over the same inputs parts the two on some position, so the
    equality above is not a property of the inputs."""
    heads, dim = 2, 16
    lengths = [37, 29, 45]
    docs = _docs(lengths, heads, heads, dim, torch.float32, seed=4)
    q, k, v, _, _ = _packed(docs)
    differ, at = 0, 0
    for d, n in zip(docs, lengths):
        block = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, at:at + n], k[:, :, at:at + n], v[:, :, at:at + n], is_causal=True)
        for step in range(n):
            one = torch.nn.functional.scaled_dot_product_attention(
                d[0][None, :, step:step + 1], d[1][None, :, :step + 1], d[2][None, :, :step + 1])
            differ += not torch.equal(one[0, :, 0], block[0, :, step])
        at += n
    assert differ > 0


def test_a_mask_whose_keys_are_not_one_run_from_the_start_is_refused():
    allowed = torch.ones(1, 4, 8, dtype=torch.bool).tril(4)
    first, count = attention_extents(torch.ones(2, 3, 5, dtype=torch.bool).tril())
    assert first.tolist() == [[0, 0, 0]] * 2 and count.tolist() == [[1, 2, 3]] * 2
    window = allowed & ~torch.ones(1, 4, 8, dtype=torch.bool).tril(-2)  # a sliding window: no run from 0
    window[0, 3, 0] = True
    with pytest.raises(ValueError, match="contiguous run"):
        attention_extents(window)
    assert TILE == 16


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_lm_heads_invariant_log_probs_are_a_rows_own_in_every_call_and_in_the_fused_sweep(dtype):
    """token_logprobs(invariant=True) (the old log-probs, the engine's sampled log-prob) gives a row the same
    bits alone, among 300 rows, and in the update's fused sweep; it equals float64 to fp32 rounding. The
    vocabulary (5,000) spans two of its chunks."""
    from flashdapo.kernels import fused_token_loss, token_logprobs
    from flashdapo.kernels.chunked import INVARIANT_CHUNK_VOCAB
    from flashdapo.kernels.fused import TILE_VOCAB

    assert INVARIANT_CHUNK_VOCAB == TILE_VOCAB < 5000
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(300, 40, generator=gen).to(dtype)
    w = (torch.randn(5000, 40, generator=gen) * 0.2).to(dtype)
    y = torch.randint(0, 5000, (300,), generator=gen)
    full, entropy = token_logprobs(h, w, y, temperature=0.7, impl="torch", invariant=True, with_entropy=True)
    logits = (h.double() @ w.double().t()) / 0.7
    reference = logits.log_softmax(-1).gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(full.double(), reference, rtol=0, atol=2e-5)
    for start, size in [(0, 1), (3, 5), (16, 16), (100, 47), (299, 1)]:
        part = token_logprobs(h[start:start + size], w, y[start:start + size], temperature=0.7, impl="torch",
                              invariant=True)
        assert torch.equal(part, full[start:start + size]), (start, size)
    for rows in (300, 37):
        _, swept, _ = fused_token_loss(h[:rows], w, y[:rows], lambda lp, idx: lp.sum(), temperature=0.7,
                                       impl="torch", invariant=True)
        assert torch.equal(swept, full[:rows]), rows

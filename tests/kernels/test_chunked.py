"""The chunked torch path's own contract: gradcheck in float64, chunk planning, no-grad use."""

import pytest
import torch

from flashdapo.kernels.chunked import (
    CUDA_CHUNK_VOCAB,
    Plan,
    chunked_token_logprobs,
    plan_chunks,
)


@pytest.mark.parametrize("outputs", ["logp", "entropy", "both"])
@pytest.mark.parametrize("chunks", [(None, None), (4, 5)])
def test_gradcheck_float64(outputs, chunks, seed):
    n, hdim, vocab = 7, 5, 13
    h = torch.randn(n, hdim, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hdim, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, vocab, (n,))

    def fn(h, w):
        logp, ent = chunked_token_logprobs(h, w, y, 0.7, outputs != "logp", chunk_tokens=chunks[0],
                                           chunk_vocab=chunks[1])
        return {"logp": (logp,), "entropy": (ent,), "both": (logp, ent)}[outputs]

    assert torch.autograd.gradcheck(fn, (h, w))


def test_gradcheck_skipped_rows(seed):
    """Rows whose upstream gradient is zero are skipped; the gradient stays exact for the others."""
    n, hdim, vocab = 9, 4, 11
    h = torch.randn(n, hdim, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hdim, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, vocab, (n,))
    keep = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1], dtype=torch.float64)
    fn = lambda h, w: (chunked_token_logprobs(h, w, y, 1.3, False, chunk_tokens=2)[0] * keep).sum()
    assert torch.autograd.gradcheck(fn, (h, w))


def test_plan_bounds_the_tile():
    tile = 1 << 20
    assert plan_chunks(1000, 1000, "cpu", tile) == Plan(1000, 1000)  # whole vocabulary: as many rows as fit
    assert plan_chunks(10_000, 1000, "cpu", tile) == Plan(2502, 419)  # 10k rows: the 16 MiB dz budget
    plan = plan_chunks(10_000, 151_936, "cpu", tile)
    assert plan.chunk_vocab == 419 and plan.chunk_tokens * plan.chunk_vocab <= tile
    assert plan_chunks(3, 50, "cpu", tile) == Plan(3, 50)
    assert plan_chunks(100, 151_936, "cpu", tile) == Plan(100, 10485)
    assert plan_chunks(16384, 152_064, "cuda") == Plan(8192, CUDA_CHUNK_VOCAB)  # 7B: 128 MiB fp32 tiles
    assert plan_chunks(5, 100, "cuda") == Plan(5, 100)


def test_no_grad_and_frozen_weight(seed):
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(20, 8)
    y = torch.randint(0, 20, (6,))
    with torch.no_grad():
        logp, ent = chunked_token_logprobs(h, w, y, 1.0, False)
    assert ent is None and not logp.requires_grad
    logp, _ = chunked_token_logprobs(h, w, y, 1.0, False)
    logp.sum().backward()
    assert h.grad is not None and w.grad is None

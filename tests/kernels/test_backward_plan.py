"""The vocabulary-outer backward's plan: the dz buffer's budget narrows the vocabulary chunks (of forward and
backward alike), and the results at narrow, ragged chunks against float64 (torch; triton under the
interpreter uses its own tiny tiles at any budget)."""

from __future__ import annotations

import pytest
import torch
from kernel_accuracy import check, impl_params, run

from flashdapo.kernels import CHUNKED_IMPLS, chunked
from flashdapo.kernels.chunked import Plan, plan_chunks


def test_dz_budget_narrows_the_chunks():
    assert plan_chunks(16384, 152_064, "cuda", dz_bytes=2) == Plan(8192, 4096)  # 7B: 128 MiB of bf16 dz
    wide = plan_chunks(131072, 152_064, "cuda", dz_bytes=2)  # 128k rows: narrowed to the budget
    assert wide.chunk_vocab * 131072 * 2 <= chunked.CUDA_DZ_BYTES and wide.chunk_vocab >= chunked.MIN_BACKWARD_VOCAB
    assert wide.chunk_tokens * wide.chunk_vocab <= chunked.CUDA_TILE_ELEMS
    assert plan_chunks(8192, 32768, "cpu") == Plan(2048, 512)  # 16 MiB of fp32 dz, 1 Mi-element tiles
    assert plan_chunks(3, 50, "cpu") == Plan(3, 50)  # never more than N or V


@pytest.fixture
def narrow_dz(monkeypatch):
    """A dz budget of a few columns: 7-column vocabulary chunks at 37 rows, which do not divide V, and
    token tiles of many more rows than the default plan's."""
    monkeypatch.setattr(chunked, "MIN_BACKWARD_VOCAB", 1)
    monkeypatch.setattr(chunked, "CPU_DZ_BYTES", 37 * 7 * 4)
    monkeypatch.setattr(chunked, "CPU_TILE_ELEMS", 21 * 7)


def _inputs(n, hdim, vocab, w_scale):
    return torch.randn(n, hdim), torch.randn(vocab, hdim) * w_scale, torch.randint(0, vocab, (n,))


@pytest.mark.parametrize("temperature", [0.05, 0.7])
@pytest.mark.parametrize("impl", impl_params(CHUNKED_IMPLS))
def test_narrow_backward_chunks_match_float64(impl, temperature, narrow_dz, seed):
    """Odd shapes, prime V, sharp and soft temperature, a third of the rows dead (masked or clipped)."""
    n, hdim, vocab = (37, 24, 97) if impl == "triton" else (37, 40, 1009)
    h, w, y = _inputs(n, hdim, vocab, 1.0 if temperature < 0.1 else 0.3)
    g, ge = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    dead = torch.rand(n) < 0.33
    g[dead], ge[dead] = 0, 0
    _, _, dh, _ = check(impl, h, w, y, temperature, g, ge)
    assert (dh[dead] == 0).all()


@pytest.mark.parametrize("impl", impl_params(CHUNKED_IMPLS))
def test_narrow_backward_chunks_zipfian_fp16(impl, narrow_dz, seed):
    """Zipfian targets (many rows on a few columns) and fp16 at realistic gradient sizes: the inverse
    gradient scale goes in as the GEMMs' alpha, nothing is flushed."""
    n, hdim, vocab = 41, 24, 97
    h, w, _ = _inputs(n, hdim, vocab, 0.3)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.5
    y = torch.multinomial(zipf, n, replacement=True)
    dtype = torch.float16 if impl == "triton" else torch.float32
    g = torch.randn(n, dtype=torch.float64) * 1e-6
    _, _, dh, dw = check(impl, h.to(dtype), w.to(dtype), y, 1.0, g, None)
    assert (dh.abs().sum(1) > 0).all() and (dw.abs().sum(1) > 0).any()


@pytest.mark.parametrize("impl", impl_params(CHUNKED_IMPLS))
def test_narrow_backward_chunks_bitwise_deterministic(impl, narrow_dz, seed):
    h, w, y = _inputs(29, 24, 97, 0.3)
    g, ge = torch.randn(29, dtype=torch.float64), torch.randn(29, dtype=torch.float64)
    first, second = run(impl, h, w, y, 0.7, g, ge), run(impl, h, w, y, 0.7, g, ge)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "two runs must be bitwise equal"

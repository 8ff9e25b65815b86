"""The Triton passes at tiles several BLOCK_V steps wide; the reported fallback of the fp32 accumulate GEMM.

Each Triton pass walks a tile's columns in BLOCK_V steps (`for c0 in range(0, bv, BLOCK_V)`) and merges
each step's running max, sum exp and entropy term into the row's statistics, rescaling what came before
by exp(m_old - m_new). The interpreter's default tiles (32 columns) are narrower than its BLOCK_V (64), so
elsewhere that loop runs once; here the tiles are 3.5 BLOCK_V wide and V = 2 tiles + 2 BLOCK_V + 11 (587,
a prime, under the interpreter), so it runs 4, 4 and 3 steps, the last one partly padded. A launch spy reads
the loop's trip count off every launch's (bv, BLOCK_V). On a GPU the same sizes in BLOCK_V units (1024) run
the compiled kernels.

Planted rows: one whose max logit lies in the third step of a tile while its target lies in the first,
one whose max (its target) lies in the last step of the second tile, one with all logits negative (no
padded column may enter the max), one masked (zero upstream gradient; dropped by the fused sweep's keep).
fp32 and fp16 operands (fp16: the 16-bit dz path); not bf16, whose `tl.dot` the interpreter computes wrongly.

Then the fp32 accumulate GEMM (gemm.mm_acc_): a torch that refuses its in-GEMM form is reported once."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import triton
from kernel_accuracy import EPS, ON_CUDA, SLACK, TRITON_MARKS, gradient_term_scales, naive_envelope, reference

from flashdapo.kernels import gemm
from flashdapo.kernels.chunked import chunked_token_logprobs
from flashdapo.kernels.fused import fused_token_loss

TEMPERATURE = 0.7
N, HDIM = 21, 20  # two token chunks (16 + 5 rows) under the interpreter; H not a multiple of 16
MAX_LATE, TARGET_LATE, ALL_NEGATIVE, MASKED = 0, 1, 2, 3  # the planted rows


def _sizes() -> tuple[int, int, int]:
    """(BLOCK_V, tile width, V) of the shipped launch config: 64, 224, 587 under the interpreter."""
    from flashdapo.kernels.triton_tiles import config

    block_v = config().block_v
    tile = 3 * block_v + block_v // 2
    vocab = 2 * tile + 2 * block_v + 11
    return block_v, tile, vocab


def _device():
    return torch.device("cuda" if ON_CUDA else "cpu")


def _inputs(dtype):
    """h, w, y on the device in `dtype`, with the planted rows (module docstring)."""
    block_v, tile, vocab = _sizes()
    h, w = torch.randn(N, HDIM), torch.randn(vocab, HDIM) * 0.3
    y = torch.randint(0, vocab, (N,))
    w[:, 0] = -1.0  # feature 0 shifts a row's logits uniformly by -h[:, 0]
    h[ALL_NEGATIVE, 0] = 100.0  # z/T ~ -143: exp(z/T - 0) underflows, so a padded 0 must not enter the max
    h[MAX_LATE, 0] = h[TARGET_LATE, 0] = 0.0
    a = h[MAX_LATE, 1:]  # the two planted rows orthogonal: neither sees the other's planted logit
    h[TARGET_LATE, 1:] -= (h[TARGET_LATE, 1:] @ a) / (a @ a) * a
    late = (2 * block_v + 7, tile + 3 * block_v + 5)  # tile 0's third step, tile 1's fourth (last)
    for row, col in zip((MAX_LATE, TARGET_LATE), late):
        w[col, 1:] = 12.0 * h[row, 1:] / h[row, 1:].square().sum()  # z = 12; the row's others ~N(0, 1.3)
    y[MAX_LATE], y[TARGET_LATE] = 5, late[1]
    h, w, dev = h.to(dtype), w.to(dtype), _device()
    z = h.double() @ w.double().T
    assert (z[ALL_NEGATIVE] < 0).all()
    for row, col in zip((MAX_LATE, TARGET_LATE), late):
        assert z[row].argmax().item() == col and z[row, col] > z[row].topk(2).values[1] + 2
        assert (col % tile) // block_v >= 2, "the row's max lies in a later step than the first"
    return h.to(dev), w.to(dev), y.to(dev)


class _LaunchSpy:
    """Stands in for a Triton kernel: records (bv, BLOCK_V) of every launch, then launches the real one."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **meta):
            self.log.append((args[self.kernel.arg_names.index("bv")], meta["BLOCK_V"]))
            return launch(*args, **meta)

        return run


@pytest.fixture
def launches(monkeypatch):
    """{"stats": [...], "grad": [...]}: (bv, BLOCK_V) of each launch of the two Triton kernels."""
    from flashdapo.kernels import triton_tiles

    log = {"stats": [], "grad": []}
    monkeypatch.setattr(triton_tiles, "_stats_kernel", _LaunchSpy(triton_tiles._stats_kernel, log["stats"]))
    monkeypatch.setattr(triton_tiles, "_grad_kernel", _LaunchSpy(triton_tiles._grad_kernel, log["grad"]))
    return log


def _run(kind, h, w, y, g, ge, keep):
    """(logp, entropy or None, dh, dW) as float64 on the CPU, and the loss (fused only), from the Triton
    passes at tiles of 16 rows (the interpreter's default, on any device) x `_sizes()[1]` columns."""
    tile = _sizes()[1]
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = None
    if kind == "fused":
        g_out = g.to(h.device, torch.float32)
        loss, logp, ent = fused_token_loss(hh, ww, y, lambda lp, rows: (lp * g_out[rows]).sum(), keep=keep,
                                           temperature=TEMPERATURE, impl="triton", chunk_tokens=16,
                                           chunk_vocab=tile)
        loss.backward()
    else:
        logp, ent = chunked_token_logprobs(hh, ww, y, TEMPERATURE, kind == "entropy", impl="triton",
                                           chunk_tokens=16, chunk_vocab=tile)
        outs = [(logp, g), *([(ent, ge)] if ge is not None else [])]
        torch.autograd.backward([o for o, _ in outs], [gr.to(o.device, o.dtype) for o, gr in outs])
    got = [None if t is None else t.detach().double().cpu() for t in (logp, ent, hh.grad, ww.grad)]
    return got, loss


def _assert_matches_float64(got, h, w, y, g, ge, rows):
    """kernel_accuracy.check's criterion (float64 reference, naive torch's own error as the envelope) on
    precomputed outputs; log-prob and entropy on `rows` only."""
    ref, naive = reference(h, w, y, TEMPERATURE, g, ge), naive_envelope(h, w, y, TEMPERATURE, g, ge)
    z_scale = max(1.0, ((h.double() @ w.double().T) / TEMPERATURE).abs().max().item())
    term_scales = gradient_term_scales(h, w, y, TEMPERATURE, g, ge)
    for i, name in enumerate(("logp", "entropy", "dh", "dW")):
        if got[i] is None:
            continue
        pick = (lambda t: t[rows]) if i < 2 else (lambda t: t)
        a, r = pick(got[i]), pick(ref[i])
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        eps = EPS[torch.float32] if i < 2 else EPS[h.dtype]
        tol = SLACK * eps * (z_scale if i < 2 else max(r.abs().max().item(), 1e-30))
        if i >= 2:
            tol += (w.shape[0], h.shape[0])[i - 2] ** 0.5 * EPS[torch.float32] * term_scales[i - 2]
        err = (a - r).abs().max().item()
        base = max((pick(other[i]) - r).abs().max().item() for other in naive)
        assert err <= base + tol, f"{name}: error {err:.3e} > naive's {base:.3e} + {tol:.3e}"
    return ref


# The grad kernel computes the padded columns of a tile's last step too, from z = 0 (their stores are masked):
# for the all-negative row, "log p" there is -m - log s ~ +143, whose exp overflows; numpy says so.
@pytest.mark.filterwarnings("ignore:overflow encountered in (exp|cast):RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["logprob", "entropy", "fused"])
@pytest.mark.parametrize("impl", [pytest.param("triton", marks=TRITON_MARKS)])
def test_multi_step_merge_matches_float64(impl, kind, dtype, launches, seed):
    """Forward and backward of the log-prob pass (no entropy term), the entropy pass (entropy in the
    forward's merge, its gradient in the backward's), and the fused sweep (loss sum(g logp)), each at tiles
    of 3.5 BLOCK_V columns, against float64."""
    block_v, tile, vocab = _sizes()
    h, w, y = _inputs(dtype)
    g = torch.randn(N, dtype=torch.float64)
    ge = torch.randn(N, dtype=torch.float64) if kind == "entropy" else None
    g[MASKED] = 0.0
    if ge is not None:
        ge[MASKED] = 0.0
    keep = torch.ones(N, dtype=torch.bool)
    keep[MASKED] = False
    got, loss = _run(kind, h, w, y, g, ge, keep.to(h.device) if kind == "fused" else None)

    # The loop ran several steps: every launch's trip count, from the arguments the kernel received.
    steps = {kernel: sorted({triton.cdiv(bv, step) for bv, step in log}) for kernel, log in launches.items()}
    expected = sorted({triton.cdiv(tile, block_v), triton.cdiv(vocab - 2 * tile, block_v)})
    assert expected == [3, 4] and vocab % block_v and vocab % tile
    assert steps == {"stats": expected, "grad": expected}, steps
    assert len(launches["stats"]) == len(launches["grad"]) == 6, "3 vocabulary tiles x 2 token chunks"

    rows = keep if kind == "fused" else torch.ones(N, dtype=torch.bool)
    ref = _assert_matches_float64(got, h, w, y, g, ge, rows)
    logp, ent, dh, _ = got
    assert (logp[rows] <= 0).all() and (ent is None or (ent[rows] >= 0).all())
    assert (dh[MASKED] == 0).all(), "a row with zero upstream gradient gets exactly zero dh"
    if kind == "fused":
        assert logp[MASKED] == 0 and ent[MASKED] == 0, "a dropped row comes back as 0"
        # Each logp may be off by 2 eps32 max |z/T| (the criterion above); the loss sums them weighted by g.
        want = (g * ref[0])[keep].sum().item()
        z_scale = ((h.double() @ w.double().T) / TEMPERATURE).abs().max().item()
        tol = SLACK * EPS[torch.float32] * z_scale * g.abs().sum().item()
        assert abs(loss.item() - want) <= tol, (loss.item(), want, tol)


# The fp32 accumulate GEMM's fallback: a torch that refuses addmm(fp32 self, 16-bit operands, out_dtype)
# on CUDA gets torch.mm(out_dtype=fp32) + add_, reported once per process.
REFUSAL = "self and mat2 must have the same dtype, but got Float and Half"  # what torch < ~2.10 raises


def _refuse(patch):
    """torch.addmm refuses out_dtype with an fp32 `self` as CUDA's check does; on a CPU the library is also
    told that it takes 16-bit operands with an fp32 result (CUDA's answer), so that the CUDA branch runs.
    The process's memory of an earlier refusal is reset."""
    real = torch.addmm

    def addmm(*args, **kwargs):
        if "out_dtype" in kwargs:
            raise RuntimeError(REFUSAL)
        return real(*args, **kwargs)

    patch.setattr(gemm, "_FP32_INPUT_REFUSED", [])
    patch.setattr(torch, "addmm", addmm)
    if not ON_CUDA:
        patch.setattr(gemm, "_native", lambda a, acc_dtype: a.dtype == acc_dtype or (
            a.dtype in gemm.HALF and acc_dtype == torch.float32))


def _fused_fp16(h, w, y, g):
    """dh, dW of the fused sweep with fp16 operands: the Triton tiles keep them 16-bit, so both fp32
    accumulators (dh of a chunk, dW) go through mm_acc_ (the torch tiles would compute in fp32)."""
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, _, _ = fused_token_loss(hh, ww, y, lambda lp, rows: (lp * g[rows]).sum(), impl="triton",
                                  chunk_tokens=8, chunk_vocab=16)
    loss.backward()
    return hh.grad, ww.grad


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=TRITON_MARKS)])
def test_refused_fp32_accumulate_warns_once(impl, monkeypatch, seed):
    """Several calls, direct and through the fused sweep (dh and dW accumulators, fp16 operands): one
    one-line GemmFallbackWarning naming the refused call, its replacement and its cost; the results equal
    those of the accepted path."""
    dev = _device()
    acc0 = torch.randn(19, 13, device=dev)
    a, b = torch.randn(19, 23, device=dev).half(), torch.randn(23, 13, device=dev).half()
    h, w = torch.randn(21, 12, device=dev).half(), (torch.randn(37, 12, device=dev) * 0.3).half()
    y, g = torch.randint(0, 37, (21,), device=dev), torch.randn(21, device=dev)
    want_acc = gemm.mm_acc_(gemm.mm_acc_(acc0.clone(), a, b, alpha=0.25), a, b, alpha=0.25)  # accepted
    want_grads = _fused_fp16(h, w, y, g)

    with monkeypatch.context() as patch, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _refuse(patch)
        acc = gemm.mm_acc_(gemm.mm_acc_(acc0.clone(), a, b, alpha=0.25), a, b, alpha=0.25)
        grads = [_fused_fp16(h, w, y, g) for _ in range(2)]
        assert gemm._FP32_INPUT_REFUSED == [REFUSAL]
    reports = [w for w in caught if issubclass(w.category, gemm.GemmFallbackWarning)]
    assert len(reports) == 1, [str(w.message) for w in caught]
    message = str(reports[0].message)
    assert "\n" not in message and "flashdapo" in Path(reports[0].filename).parts  # WarningLines: one line
    for part in ("refused torch.addmm(acc fp32, operands float16, out_dtype=float32", REFUSAL,
                 "torch.mm(out_dtype=float32) then acc.add_", "[19, 13]", "12 bytes an element"):
        assert part in message, (part, message)
    # Bitwise on a CPU (both paths: an fp32 product, then the add); cuBLAS may pick other kernels for the
    # accepted in-GEMM form than for the plain product, so on a GPU the last bits may differ.
    tol = dict(rtol=1e-6, atol=1e-6 * want_acc.abs().max().item()) if ON_CUDA else dict(rtol=0, atol=0)
    torch.testing.assert_close(acc, want_acc, **tol)
    for got in grads:
        for x, want in zip(got, want_grads):
            torch.testing.assert_close(x, want, **(dict(rtol=2e-3, atol=1e-3 * want.abs().max().item())
                                                 if ON_CUDA else tol))

"""The three library GEMM forms the drivers use, each one call on CUDA (cuBLAS), fp32 accumulation inside.

- `mm_f32(a, b)`: a @ b with an fp32 (fp64) result, for the logit tiles z = h W^T.
- `mm_acc_(acc, a, b, alpha)`: acc += alpha a @ b in place, acc fp32/fp64: the accumulate happens in the
  GEMM (beta = 1), no separate result tensor and no second `add_` kernel. For 16-bit operands on CUDA this
  is `torch.addmm(..., out_dtype=torch.float32, out=acc)`; a torch whose check still wants `self` in the
  operands' dtype (before ~2.10) gets an fp32 result and one add instead, decided once per process and
  reported once (`GemmFallbackWarning`).
- `mm_into_(out, a, b, alpha)`: out = alpha a @ b written once in out's dtype (beta = 0: out's old
  contents, even NaN, are ignored), e.g. one vocabulary chunk of dW straight into the bf16 gradient.

`alpha` carries the inverse fp16 gradient scale: it multiplies the fp32 accumulator inside the GEMM, so no
16-bit intermediate ever holds the scaled values. On a CPU, 16-bit operands (only the Triton interpreter's
tests use them) are upcast to fp32 first: CPU BLAS has no fp32-output 16-bit GEMM.
"""

from __future__ import annotations

import warnings

import torch

HALF = (torch.bfloat16, torch.float16)


def _native(a: torch.Tensor, acc_dtype: torch.dtype) -> bool:
    """Whether the library can take a's dtype with an `acc_dtype` result in one call."""
    return a.dtype == acc_dtype or (a.is_cuda and a.dtype in HALF and acc_dtype == torch.float32)


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b; 16-bit operands give an fp32 result (cuBLAS out_dtype on CUDA, an upcast on CPU)."""
    if a.dtype not in HALF:
        return a @ b
    return torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else a.float() @ b.float()


class GemmFallbackWarning(UserWarning):
    """A library GEMM form was refused; an equivalent one that moves more bytes runs instead."""


_FP32_INPUT_REFUSED: list[str] = []  # the refusal's message, once a torch refuses it (see mm_acc_)


def _report_refusal(err: RuntimeError, acc: torch.Tensor, a: torch.Tensor) -> None:
    """Remember the refusal (later calls skip the attempt) and warn, once per process: the fallback is
    correct but slower, and a silent slowdown of every LM-head backward is hard to find in a profile."""
    reason = (str(err).strip().splitlines() or ["(no message)"])[0]
    _FP32_INPUT_REFUSED.append(reason)
    rows, cols = acc.shape
    warnings.warn(
        f"torch {torch.__version__} refused torch.addmm(acc fp32, operands "
        f"{str(a.dtype).removeprefix('torch.')}, out_dtype=float32, out=acc): {reason}; the LM head's fp32 "
        "accumulations (dh += dz W, the fused sweep's dW) run as torch.mm(out_dtype=float32) then acc.add_ "
        "instead, same math, at the cost per call of an fp32 temporary the size of acc (here "
        f"[{rows}, {cols}], {rows * cols * 4 / 2**20:.1f} MiB) and one more kernel moving 12 bytes an "
        "element",
        GemmFallbackWarning, stacklevel=2)


def mm_acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """acc += alpha a @ b, in place, accumulated inside the GEMM (acc fp32, or fp64 for fp64 operands).
    Reads a, b and acc, writes acc; where the library refuses the in-GEMM form for 16-bit operands
    (GemmFallbackWarning, once), a temporary fp32 a @ b is written, then added (12 more bytes an element)."""
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b, alpha=alpha)
    native = _native(a, acc.dtype)
    if native and not _FP32_INPUT_REFUSED:
        try:
            return torch.addmm(acc, a, b, alpha=alpha, out_dtype=acc.dtype, out=acc)
        # torch < ~2.10 checks "self and mat2 must have the same dtype" (host side)
        except RuntimeError as err:
            if "dtype" not in str(err):
                raise
            _report_refusal(err, acc, a)
    if native:  # that older torch: an fp32 result, then one add (v2's two kernels)
        return acc.add_(mm_f32(a, b), alpha=alpha)
    return acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), alpha=alpha)


def mm_into_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """out = alpha a @ b in out's dtype, one write (fp32 accumulation inside the library for 16-bit)."""
    if a.dtype == out.dtype:
        return torch.addmm(out, a, b, beta=0, alpha=alpha, out=out)
    return out.copy_(torch.mm(a.to(torch.float32), b.to(torch.float32)).mul_(alpha))

"""The operations of vLLM's batch-invariant forward, with a backward: the trainer's side of exact on-policy
with the co-located vLLM engine (trainer.batch_invariant with rollout.engine vllm; docs/algorithm.md).

Written against vLLM 0.32's sources, for CUDA; **not yet run on a GPU.** The engine then runs in vLLM's
batch-invariant mode (VLLM_BATCH_INVARIANT=1, eager, every custom op on: rollout/vllm_invariant.py), where
each layer calls one kernel that gives a row the same bits whatever the batch. The trainer gets a token's
hidden state bit for bit only by calling those same kernels, in the same shapes, with the same inputs:

- **linear**: `linear_batch_invariant` (vLLM's persistent Triton matmul; its tile along K is chosen by the
  weight's shape (N, K), never by the row count, `determinism/batch_invariant_configs.py`). So q/k/v and
  gate/up are multiplied as vLLM's merged weights, one GEMM each (models/vllm_matching.py).
- **rms_norm**: `rms_norm_batch_invariant` without a residual (vLLM's Triton kernel: the mean of squares in
  fp32, then x * rsqrt * weight in fp32, one rounding): the first layer's input norm, q_norm and k_norm.
- **add_rms_norm**: vLLM's fused residual-add norm (`_custom_ops.fused_add_rms_norm`, a CUDA kernel, other
  arithmetic than the Triton one), which every other norm of vLLM's decoder calls with (x, residual). It adds
  in the input dtype first, as the HF layer does before its norm; the trainer hands it that sum and a residual
  of -0.0 (x + -0.0 is x for every x, signed zeros included), so it normalizes the same bits.
- **silu_and_mul**: vLLM's `_C.silu_and_mul` on the merged gate/up output.
- **rotary**: vLLM's rotary op with a cos/sin cache built by vLLM's own `get_rope` on the same device.
- **attention**: vLLM's flash-attention varlen kernel with `num_splits=1` (no split over keys: vLLM's own
  choice in batch-invariant mode, `v1/attention/backends/flash_attn.py`), causal, per document of the packed
  row.

The backward of each is written here in torch (fp32 where it reduces): gradients need to be right, not the
engine's bits (only forwards are compared). `reference_ops` gives the same functions with plain torch
forwards, so the layer wiring and these backwards are tested on any machine against transformers' own
forward and autograd (tests/models/test_vllm_matching.py); the bits need the GPU (tests/rollout/
test_exact_on_policy_vllm.py, `cuda`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .hf import decoder_layers
from .packing import DocumentBounds, document_attention


@dataclass(frozen=True)
class MatchingOps:
    """The forwards the matching layers call (autograd is added by the functions below)."""

    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    """x [N, in], weight [out, in], bias [out] or None -> [N, out]."""
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """x [N, d], weight [d], eps -> [N, d]: vLLM's norm called without a residual."""
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """x [N, d] (the residual sum), weight, eps -> [N, d]: vLLM's norm called with a residual."""
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    """[N, 2f] (gate then up) -> silu(gate) * up [N, f]."""
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    """positions [N], q [N, H*D], k [N, Hkv*D], head size -> rotated (q, k), new tensors."""
    rotary_cos_sin: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    """positions [N], head size -> (cos, sin) [N, D/2] fp32, for the backward."""
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DocumentBounds, float], torch.Tensor]
    """q [T, H, D], k/v [T, Hkv, D], the packed row's documents, scale -> [T, H, D], causal per document."""


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, impl):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return impl(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad @ weight, grad.t() @ x, grad_bias, None


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in fp32 for the backwards' arithmetic (fp64 stays fp64)."""
    return t if t.dtype == torch.float64 else t.float()


def _norm_backward(x, weight, eps, grad):
    """d/dx and d/dw of y = x * rsqrt(mean(x^2) + eps) * w, in fp32 (fp64 for fp64)."""
    xf, gf, wf = _wide(x), _wide(grad), _wide(weight)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    grad_weight = (gf * xhat).sum(0)
    gxhat = gf * wf
    grad_x = rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, impl):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return impl(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return (*_norm_backward(x, weight, ctx.eps, grad), None, None)


class _SiluAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, impl):
        ctx.save_for_backward(gate_up)
        return impl(gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        gate, up = _wide(gate_up).chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        g = _wide(grad)
        grad_gate = g * up * sig * (1 + gate * (1 - sig))
        grad_up = g * gate * sig
        return torch.cat([grad_gate, grad_up], dim=-1).to(gate_up.dtype), None


class _Rotary(torch.autograd.Function):
    """Neox-style rotation of each head's halves by the position's angles; its backward rotates back."""

    @staticmethod
    def forward(ctx, positions, q, k, head_size, ops):
        ctx.save_for_backward(positions)
        ctx.head_size, ctx.ops = head_size, ops
        return ops.rotary(positions, q, k, head_size)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        (positions,) = ctx.saved_tensors
        cos, sin = ctx.ops.rotary_cos_sin(positions, ctx.head_size)
        return None, _rotate(grad_q, cos, -sin, ctx.head_size), _rotate(grad_k, cos, -sin, ctx.head_size), \
            None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> torch.Tensor:
    """x [N, heads*D] rotated neox-style by (cos, sin) [N, D/2] in fp32 (fp64 for fp64 x), back in x's
    dtype."""
    heads = _wide(x.reshape(x.shape[0], -1, head_size))
    x1, x2 = heads.chunk(2, dim=-1)
    c, s = cos[:, None, :].to(heads.dtype), sin[:, None, :].to(heads.dtype)
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return out.reshape(x.shape).to(x.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bounds, scale, impl):
        ctx.save_for_backward(q, k, v)
        ctx.bounds, ctx.scale = bounds, scale
        return impl(q, k, v, bounds, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            out = _sdpa_documents(q_, k_, v_, ctx.bounds, ctx.scale)
            grads = torch.autograd.grad(out, (q_, k_, v_), grad)
        return (*grads, None, None, None)


def _sdpa_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: DocumentBounds,
                    scale: float) -> torch.Tensor:
    """packing.document_attention (SDPA per document) in the varlen layout: q [T, H, D], k/v [T, Hkv, D]."""
    return document_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), bounds.offsets, scale)[0]


def linear(ops: MatchingOps, x, weight, bias=None):
    """ops.linear with a backward."""
    return _Linear.apply(x, weight, bias, ops.linear)


def rms_norm(ops: MatchingOps, x, weight, eps, residual_kernel: bool):
    """ops.add_rms_norm (`residual_kernel`) or ops.rms_norm, with a backward."""
    return _RMSNorm.apply(x, weight, eps, ops.add_rms_norm if residual_kernel else ops.rms_norm)


def silu_and_mul(ops: MatchingOps, gate_up):
    """ops.silu_and_mul with a backward."""
    return _SiluAndMul.apply(gate_up, ops.silu_and_mul)


def rotary(ops: MatchingOps, positions, q, k, head_size: int):
    """ops.rotary with a backward."""
    return _Rotary.apply(positions, q, k, head_size, ops)


def attention(ops: MatchingOps, q, k, v, bounds: DocumentBounds, scale: float):
    """ops.attention with a backward (SDPA recomputed per document)."""
    return _Attention.apply(q, k, v, bounds, scale, ops.attention)


def reference_ops(rope_theta: float) -> MatchingOps:
    """The same operations in plain torch (HF's arithmetic): the wiring and the backwards are tested with
    them."""

    def norm(x, weight, eps):  # in fp32 whatever x's dtype, as HF's norms compute
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * y.to(x.dtype)

    def cos_sin(positions, head_size):  # in fp32, as vLLM's cache and HF's rotary compute them
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
        freqs = positions.float()[:, None] * inv_freq[None, :].to(positions.device)
        return freqs.cos(), freqs.sin()

    def rotate(positions, q, k, head_size):
        cos, sin = cos_sin(positions, head_size)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return _rotate(q, cos, sin, head_size), _rotate(k, cos, sin, head_size)

    return MatchingOps(
        linear=F.linear,
        rms_norm=norm, add_rms_norm=norm,
        silu_and_mul=lambda gu: F.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1],
        rotary=rotate, rotary_cos_sin=cos_sin, attention=_sdpa_documents)


def vllm_ops(hf: torch.nn.Module, device: torch.device) -> MatchingOps:
    """vLLM's batch-invariant kernels for `hf`'s decoder (module docstring); ConfigError, one line, where they
    cannot run."""
    if device.type != "cuda":
        raise ConfigError(f"trainer.batch_invariant with rollout.engine vllm needs CUDA (vLLM's "
                          f"batch-invariant kernels); this run is on {device.type}: use rollout.engine torch")
    try:
        from vllm import _custom_ops as vllm_ops_module
        from vllm.model_executor.determinism.batch_invariant import (
            linear_batch_invariant,
            rms_norm_batch_invariant,
        )
        from vllm.model_executor.layers.rotary_embedding import get_rope
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version
    except ImportError as e:
        raise ConfigError(f"trainer.batch_invariant with rollout.engine vllm: vLLM's kernels are not "
                          f"importable ({e}); install the gpu extra") from None
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    head_size = decoder_layers(hf)[0].self_attn.head_dim
    with torch.device(device):
        rope = get_rope(head_size, config.max_position_embeddings, True,
                        getattr(config, "rope_parameters", None), torch.float32)
    cache = rope.cos_sin_cache.to(device)
    cache_in = functools.cache(cache.to)  # one cast per dtype, not one a layer and a forward
    fa_version = get_flash_attn_version(head_size=head_size)  # as vLLM's flash-attention backend asks

    def fused_norm(x, weight, eps):
        out = x.contiguous().clone()
        vllm_ops_module.fused_add_rms_norm(out, torch.full_like(out, -0.0), weight, eps)
        return out

    def silu_mul(gate_up):
        out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
        torch.ops._C.silu_and_mul(out, gate_up.contiguous())  # what vLLM's SiluAndMul calls on CUDA
        return out

    def rotate(positions, q, k, head_size_):
        q, k = q.contiguous().clone(), k.contiguous().clone()
        vllm_ops_module.rotary_embedding(positions, q, k, head_size_, cache_in(q.dtype), True)
        return q, k

    def cos_sin(positions, head_size_):
        cos, sin = cache[positions].float().chunk(2, dim=-1)
        return cos, sin

    def flash(q, k, v, bounds, scale):
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=bounds.cu_seqlens, cu_seqlens_k=bounds.cu_seqlens,
                                      max_seqlen_q=bounds.longest, max_seqlen_k=bounds.longest,
                                      softmax_scale=scale, causal=True, num_splits=1, fa_version=fa_version)

    return MatchingOps(linear=linear_batch_invariant, rms_norm=rms_norm_batch_invariant,
                       add_rms_norm=fused_norm, silu_and_mul=silu_mul, rotary=rotate, rotary_cos_sin=cos_sin,
                       attention=flash)


__all__ = ["MatchingOps", "attention", "linear", "reference_ops", "rms_norm", "rotary", "silu_and_mul",
           "vllm_ops"]

"""A CPU stand-in for flash-attn's `flash_attn_varlen_func`: it checks the inputs against flash-attn's
documented contract and computes what the kernel computes, in float64, so that the trainer's flash-attn
path runs in tests on any machine.

The contract, from flash-attn 2's source (flash_attn/flash_attn_interface.py, the docstring of
flash_attn_varlen_func; csrc/flash_attn/flash_api.cpp, mha_varlen_fwd's checks):
- q [total_q, nheads, headdim], k and v [total_k, nheads_k, headdim]; fp16 or bf16 only ("FlashAttention only
  support fp16 and bf16 data type"), k and v of q's dtype; last dimension contiguous ("Input tensor must have
  contiguous last dimension"); headdim <= 256; nheads divisible by nheads_k ("Number of heads in key/value must
  divide number of heads in query"), query heads [i * g, (i + 1) * g) reading KV head i (g = nheads / nheads_k).
- cu_seqlens_q/k: (batch_size + 1,), dtype torch.int32, on the device of q, contiguous; cumulative lengths.
- max_seqlen_q/k: int, the maximum sequence length in the batch.
- window_size (left, right), -1 meaning unbounded: query i attends keys in [i - left, i + right]; with
  causal=True the causal mask is aligned to the bottom right (seqlen_q == seqlen_k here: j <= i).
The stand-in also requires what the trainer always passes: causal=True and no dropout.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, field

import torch


@dataclass
class Call:
    """What one call received (for tests to assert on)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    window_size: tuple[int, int]
    heads: int
    kv_heads: int


@dataclass
class FlashStandIn:
    """The fake module's function and the record of its calls."""

    calls: list[Call] = field(default_factory=list)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        assert causal is True and dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None, "trainer's call"
        assert not return_attn_probs and block_table is None
        left, right = window_size
        assert isinstance(left, int) and isinstance(right, int) and left >= -1 and right >= -1, window_size
        self.calls.append(Call(cu_seqlens_q, max_seqlen_q, tuple(window_size), q.shape[1], k.shape[1]))
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        bounds = cu_seqlens_q.tolist()
        out = [_reference(q[a:b], k[a:b], v[a:b], scale, left, right) for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(out).to(q.dtype)


def _check(q, k, v, cu_q, cu_k, max_q, max_k) -> None:
    """flash-attn's input contract (see the module docstring)."""
    assert q.dim() == k.dim() == v.dim() == 3, (q.shape, k.shape, v.shape)
    assert q.dtype in (torch.float16, torch.bfloat16), f"flash-attn takes fp16/bf16 only, got {q.dtype}"
    assert k.dtype == v.dtype == q.dtype, (q.dtype, k.dtype, v.dtype)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "last dimension must be contiguous"
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] <= 256, (q.shape, k.shape)
    assert k.shape == v.shape and q.shape[1] % k.shape[1] == 0, (q.shape, k.shape)
    for cu in (cu_q, cu_k):
        assert cu.dtype == torch.int32 and cu.device == q.device and cu.is_contiguous() and cu.dim() == 1, cu
    assert torch.equal(cu_q, cu_k), "self-attention: the same boundaries for q and k"
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    assert cu_q.numel() >= 2 and cu_q[0] == 0 and min(lengths) >= 0, cu_q
    assert int(cu_q[-1]) == q.shape[0] == k.shape[0], (cu_q[-1], q.shape, k.shape)
    assert type(max_q) is int and type(max_k) is int, "max_seqlen must be a python int"
    assert max_q == max_k == max(lengths), (max_q, max_k, max(lengths))


def _reference(q, k, v, scale, left, right):
    """One sequence, [L, H, D] -> [L, H, D], float64 softmax(q k^T * scale) v under the causal and window
    masks, query head h reading KV head h // (H / Hkv)."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))  # [heads, L, D]
    k, v = (t.repeat_interleave(groups, dim=0) for t in (k, v))
    i = torch.arange(q.shape[1])[:, None]
    j = torch.arange(k.shape[1])[None, :]
    visible = j <= i
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    scores = (q @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def install(monkeypatch=None) -> FlashStandIn:
    """Make `import flash_attn` give the stand-in (through pytest's monkeypatch when given, so that it is
    removed after the test; else for the rest of the process, as torchrun scripts want)."""
    stand_in = FlashStandIn()
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = stand_in.flash_attn_varlen_func
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, "flash_attn", module)
    else:
        sys.modules["flash_attn"] = module
    return stand_in

"""Which LM-head design the DAPO update uses on a GPU: the generic driver (token_logprobs, then the loss:
8 N H V FLOPs) or the fused sweep (fused_token_loss: the loss's gradient inside the forward, 6 N H V), from
the kernel cost model (flashdapo/kernels/cost.py) at that GPU's rates.

The model says the fused sweep is faster on every GPU it knows (its 2 N H V fewer FLOPs outweigh its
exposed bytes wherever the GEMMs are compute-bound, more so on a low-ridge GPU such as the H20), for
~3 GB more memory at the 7B-32B shapes (its fp32 dW accumulator and tile set). So: the fused sweep where
the model predicts at least `MIN_SAVING` of the LM head's time saved and its extra memory stays under
`MAX_EXTRA_FRACTION` of the GPU's memory; the generic path on an unknown GPU (the earlier default) or a
small one. On a CPU the fused sweep (measured faster there: bench/results/NOTES.md). docs/kernels.md says why.
"""

from __future__ import annotations

import torch

from . import fused_loss_default, resolve_impl
from .cost import fused, generic
from .gpus import GPU, gpu_of_device

MIN_SAVING = 0.10
MAX_EXTRA_FRACTION = 0.05


def lm_head_design(gpu: GPU | None, tokens: int, hidden: int, vocab: int, softcap: bool = False) -> str:
    """'fused' or 'generic' for `tokens` rows of an LM head [vocab, hidden] in bf16 on `gpu` (None: unknown);
    `softcap`: the model caps its logits (Gemma), which the model counts as SFU work in both designs."""
    if gpu is None:
        return "generic"
    rates = gpu.kernel_rates()
    g = generic(tokens, hidden, vocab, rates=rates, softcap=softcap)
    f = fused(tokens, hidden, vocab, rates=rates, softcap=softcap)
    extra = (f.peak_extra_gb - g.peak_extra_gb) * 1e9
    return "fused" if f.ms <= (
        1 - MIN_SAVING) * g.ms and extra <= MAX_EXTRA_FRACTION * gpu.memory_bytes else "generic"


def use_fused_loss(impl: str, device: torch.device, tokens: int, hidden: int, vocab: int,
                   softcap: bool = False) -> bool:
    """Whether the update passes its loss to the policy's forward (the fused sweep) on `device`."""
    if device.type != "cuda" or resolve_impl(impl, device) not in ("triton", "torch"):
        return fused_loss_default(impl, device)
    gpu = gpu_of_device(torch.cuda.get_device_name(device))
    return lm_head_design(gpu, tokens, hidden, vocab, softcap) == "fused"


__all__ = ["MAX_EXTRA_FRACTION", "MIN_SAVING", "lm_head_design", "use_fused_loss"]

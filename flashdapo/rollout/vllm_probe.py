"""Where a co-located vLLM's forward parts from the trainer's: each parameter group's output on one sequence.

Used only after a failed push check (`trainer/observe/logprob_check.py`), to name the parameter groups that differ.
Forward hooks on the family's parameter groups (models/hf.py; Qwen2-style: `model.embed_tokens`,
`model.layers[i]`, `model.norm`) record
their outputs while the engine scores the sequence (one request: its tokens are the rows of vLLM's
flattened batch, in order). vLLM's decoder layers return `(hidden, residual)` with the residual add
deferred to the next layer's fused norm (`models/qwen2.py` `Qwen2DecoderLayer.forward`), so a layer's
residual stream is their sum, as HF's layer output is; the final norm returns `(normed, residual)`.
Under tensor parallelism these outputs are already all-reduced (full on every rank). Hooks do not fire
inside captured CUDA graphs or compiled regions: then nothing is recorded and the caller says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..models.hf import group_modules

__all__ = ["stream_of", "vllm_group_outputs"]


def stream_of(name: str, output: Any) -> torch.Tensor:
    """The residual stream (or the normed / embedded states) a group's module returned, as [tokens, hidden]."""
    if isinstance(output, (tuple, list)):
        if name.startswith("layers.") and len(output) > 1 and isinstance(output[1], torch.Tensor):
            output = output[0] + output[1]  # vLLM: (hidden, residual) with the add deferred
        else:
            output = output[0]
    return output.detach().float().reshape(-1, output.shape[-1]).cpu()


def vllm_group_outputs(llm: Any, score: Callable[[], Any], model_type: str) -> dict[str, torch.Tensor]:
    """Run `score()` (one sequence through the engine) with hooks on vLLM's groups; their outputs by name
    (the last call of each, i.e. the sequence's prefill), empty where no hook fired."""
    captured: dict[str, torch.Tensor] = {}
    handles: list[Any] = []

    def attach(model: nn.Module) -> None:
        for name, module in group_modules(model, model_type):
            handles.append(module.register_forward_hook(
                lambda _m, _inputs, out, name=name: captured.__setitem__(name, stream_of(name, out))))

    llm.apply_model(attach)
    try:
        score()
    finally:
        for handle in handles:
            handle.remove()
    return captured

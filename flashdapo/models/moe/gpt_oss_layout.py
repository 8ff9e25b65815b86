"""GPT-OSS's transformers-named tensors in the names and layout vLLM's GptOssForCausalLM loads in place.

transformers 5 holds a GPT-OSS layer's experts fused with biases: `mlp.experts.gate_up_proj` [E, H, 2I] (gate
and up interleaved along the last dim: gate = [..., ::2], up = [..., 1::2]), `gate_up_proj_bias` [E, 2I],
`down_proj` [E, I, H], `down_proj_bias` [E, H]; the attention's `self_attn.sinks` [heads]; the embedding
`model.embed_tokens`. vLLM 0.32 (`model_executor/models/gpt_oss.py`, unquantized path `_load_weights_other`)
renames the embedding (`model.embedding`) and the attention (`.attn.`), keeps q/k/v/o and the router, and
takes the experts two ways:

- whole fused tensors (`...mlp.experts.w13_weight` [E, H, 2I], interleaved like transformers'), copied with
  `param.copy_` straight into the parameter, and the sinks likewise with `param.data.copy_`;
- one expert at a time (`...mlp.experts.<e>.w13_weight` [H, 2I], `.<e>.w13_bias` [2I], `.<e>.w2_weight` [I,
  H], `.<e>.w2_bias` [H]: each expert's slice of transformers' tensors, same interleaved order), through the
  experts' weight loader (`GptOssRoutedExperts.weight_loader`, which transposes and slices for tensor
  parallelism).

The in-place reload (sync/vllm.py) only sees loads that go through a parameter's weight loader (it
buffers them while the layer sits on the meta device), so the fused copies and the sinks' copy are lost in it
(vLLM logs "OAIAttention: Failed to load weights" and keeps the old values). So the push streams the experts
one at a time (views of the fused tensors, no copy) and sets the sinks after the reload (`is_sinks`;
sync/vllm.py copies them). Every tensor name here is vLLM's own, which its name mapper leaves unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

__all__ = ["is_sinks", "to_vllm_gpt_oss"]

_EXPERTS = re.compile(r"^(?P<experts>(?:.*\.)?mlp\.experts)\."
                      r"(?P<proj>gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")
_VLLM_EXPERT = {"gate_up_proj": "w13_weight", "gate_up_proj_bias": "w13_bias",
                "down_proj": "w2_weight", "down_proj_bias": "w2_bias"}
"""transformers' fused GPT-OSS expert tensor -> the per-expert parameter suffix vLLM's loader streams."""
_RENAMES = ((".embed_tokens.", ".embedding."), (".self_attn.", ".attn."))


def to_vllm_gpt_oss(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream in vLLM's GPT-OSS names: each fused expert tensor as its per-expert slices
    (`model.layers.0.mlp.experts.gate_up_proj` [E, H, 2I] -> `model.layers.0.mlp.experts.<e>.w13_weight` [H,
    2I], views), the embedding and attention renamed (`model.embedding.weight`,
    `model.layers.0.attn.q_proj.weight`, `model.layers.0.attn.sinks`); every other tensor (router, norms,
    head) unchanged, in order."""
    for name, tensor in named_tensors:
        match = _EXPERTS.match(name)
        if match is None:
            for old, new in _RENAMES:
                name = name.replace(old, new, 1)
            yield name, tensor
            continue
        suffix = _VLLM_EXPERT[match["proj"]]
        for e in range(tensor.shape[0]):
            yield f"{match['experts']}.{e}.{suffix}", tensor[e]


def is_sinks(name: str) -> bool:
    """Whether a vLLM GPT-OSS tensor name is an attention layer's sinks (`model.layers.N.attn.sinks`)."""
    return name.endswith(".attn.sinks")

"""Full, HF-named tensors out of a (possibly FSDP2-sharded) model, one at a time.

Used by the rollout engines' `wake(weights)` (the vLLM engine loads the stream) and by the HF export.

The choices, before the code:

- **What is walked.** `named_parameters()` (which lists a tied parameter once, under the first name
  module traversal reaches) and then the *persistent* buffers of every module; non-persistent buffers
  such as RoPE's `inv_freq` are not part of an HF checkpoint and are skipped. The order is the module
  tree's, identical on every rank: FSDP2 all-gathers are collectives, so every rank must gather the same
  tensor at the same time. Never filter on per-rank data (shard sizes, pointers) before gathering.
- **Tied embeddings.** Qwen2.5-0.5B/1.5B/3B tie `lm_head.weight` to `model.embed_tokens.weight`; the two
  names are one `nn.Parameter` (transformers 5 and FSDP2 both keep it shared), so only
  `model.embed_tokens.weight` is emitted. That is what HF `save_pretrained` writes and what vLLM expects:
  its loader treats `lm_head.weight` as an alias of the embedding when `tie_word_embeddings` is set
  (vllm 0.33 `model_executor/models/utils.py`, `_get_tied_embedding_params`).
- **Names.** Wrapper path components are removed: `_checkpoint_wrapped_module.` (activation
  checkpointing), `_orig_mod.` (`torch.compile`), `_fsdp_wrapped_module.` (FSDP1). FSDP2's
  `fully_shard` does not rename. Pass the HF module itself (e.g. `policy.hf`, not the policy wrapper
  that holds it as `.hf`), so names start with `model.` / `lm_head.` as in the checkpoint.
- **Gathering.** A DTensor value is first cast to `dtype` shard-locally (an elementwise cast commutes with
  the gather and halves the bytes moved for bf16), then `DTensor.full_tensor()` all-gathers it. With
  FSDP2 CPU offload the local shard lives on the CPU while the mesh is CUDA; it is moved to the mesh's
  device before gathering. Plain tensors pass through (cast when asked). Peak extra memory: one full
  parameter, plus whatever the consumer still holds of the previous one.
- **Expert parallelism** (models/moe/expert_parallel.py): a MoE layer's fused expert weights are DTensors of
  the whole [num_experts, ...] tensor on the 2-D ("efsdp", "ep") mesh, gathered over both dimensions, one
  after the other (`full_tensor_by_dim`): every rank receives all experts, the same names and shapes as at E =
  1.
- Runs under `torch.no_grad`; yielded tensors are detached and must not be mutated by the consumer
  (a plain tensor may be the model's own storage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .moe.expert_parallel import full_tensor_by_dim

__all__ = ["WRAPPER_PREFIXES", "hf_name", "iter_full_state_dict"]

WRAPPER_PREFIXES: tuple[str, ...] = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""Module-path components added by wrappers (activation checkpointing, torch.compile, FSDP1)."""


def hf_name(name: str) -> str:
    """`name` without wrapper path components (anywhere in the path)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once) then persistent buffers, in module-tree order."""
    yield from model.named_parameters()
    for module_name, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer_name not in skip:
                yield (f"{module_name}.{buffer_name}" if module_name else buffer_name), buffer


def _full(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The full tensor of `value` (all-gathered when it is a DTensor), cast to `dtype` if given."""
    value = value.detach()
    cast = dtype is not None and value.is_floating_point() and value.dtype != dtype
    if not isinstance(value, DTensor):
        return value.to(dtype) if cast else value
    if cast:
        value = value.to(dtype)  # shard-local elementwise cast: fewer bytes to gather
    mesh = value.device_mesh
    local = value.to_local()
    if local.device.type != mesh.device_type:  # FSDP2 CPU offload: shard on host, NCCL mesh on GPU
        local = local.to(mesh.device_type)
        value = DTensor.from_local(local, mesh, value.placements, run_check=False,
                                   shape=value.shape, stride=value.stride())
    return full_tensor_by_dim(value)


@torch.no_grad()
def iter_full_state_dict(model: nn.Module, dtype: torch.dtype | None = None,
                         only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` for every parameter and persistent buffer of `model`, one at a time.

    DTensor (FSDP2) values are all-gathered with `full_tensor()`, so EVERY rank of the mesh must consume
    this iterator to the end, in step with the others. Floating-point tensors are cast to `dtype` when it
    is given. Tied parameters are yielded once (first name). Raises ValueError if two tensors map to the
    same name after wrapper prefixes are stripped. `only(name)`: the tensors to gather (a test of the name
    alone, the same on every rank), e.g. LoRA's adapters.
    """
    seen: set[str] = set()
    for raw_name, value in named_tensors(model):
        name = hf_name(raw_name)
        if name in seen:
            raise ValueError(f"two tensors are named {name!r} once wrapper prefixes are removed "
                             f"({raw_name!r})")
        seen.add(name)
        if only is not None and not only(name):
            continue
        full = _full(value, dtype)
        yield name, full
        del full

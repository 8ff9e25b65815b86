"""Pushing the trainer's weights into a running vLLM engine, in place (vLLM 0.32 CPU build, 0.33 and 0.34, whose
reload API is the same; paths inside the wheel).

The choices, before the code:

- **The reload API.** After start-up a layer's parameters are no longer what its weight loaders expect: on
  vLLM's CPU platform every linear weight is replaced by a packed copy for oneDNN / the SGL kernels and a
  bare `Parameter` without `weight_loader` (`model_executor/layers/utils.py`,
  `dispatch_cpu_unquantized_gemm`), so a plain `model.load_weights` crashes (`'Parameter' object has no
  attribute 'weight_loader'`); quantized layers are repacked likewise on GPUs. vLLM's supported way to
  load new weights into a running engine is its layerwise reload (`model_executor/model_loader/reload/`):
  `collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format": True})`
  (`v1/worker/gpu_worker.py` -> `gpu_model_runner.py` `reload_weights` -> `reload/inplace.py`) puts every
  layer back in its checkpoint form, buffers the weights streamed for it, and when a layer has all of
  them loads them with the original loaders, runs its `process_weights_after_loading` (repacking) and
  copies the result into the original storage. HF names go in unchanged: vLLM's Qwen2 loader stacks
  q/k/v into `qkv_proj` and gate/up into `gate_up_proj` and slices for TP (`models/qwen2.py`). With
  external_launcher the worker runs in this process (`v1/executor/uniproc_executor.py` `collective_rpc`),
  so the iterator may be a generator that all-gathers FSDP2 shards as it goes. The iterator is always
  given: without it `reload_weights` reads the checkpoint from disk and silently undoes training (trl#5312).
- **Tied heads.** A tied `lm_head.weight` is never streamed (HF checkpoints do not hold it; it is the
  embedding). vLLM's lm_head is then a layer of its own whose weight *is* the embedding's Parameter
  (`vocab_parallel_embedding.py` `tie_weights`): the reload refreshes the shared tensor through the
  embedding, but skips the head's processing ("Tied parameters will only reflect processing from one of
  the parent layers", `reload/__init__.py`). On CPU the head's packed copy would stay stale (the issue's
  0.25 mean / 0.76 max |delta logp| after a push). So after the stream, the head's
  `quant_method.process_weights_after_loading` runs again (a no-op on CUDA for unquantized heads).
- **Completeness.** Every vLLM parameter must be the target of a streamed tensor, and every stacked one
  must get all its shards; else RuntimeError (a parameter left out would keep its dummy or older values).
  The names are read before the reload (during it, layers are on the meta device).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["STACKED", "push_weights", "vllm_target"]

STACKED: tuple[tuple[str, str, str | int], ...] = (
    (".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1),
)
"""vLLM Qwen2Model.hf_to_vllm_mapper `orig_to_new_stacked`: HF substring -> (vLLM substring, shard)."""
_SHARDS = {".qkv_proj": {"q", "k", "v"}, ".gate_up_proj": {0, 1}}


def vllm_target(name: str) -> tuple[str, str | int | None]:
    """The vLLM parameter an HF tensor lands in, and its shard of a stacked parameter (None if unstacked)."""
    shard = None
    for hf_part, vllm_part, shard_id in STACKED:
        if hf_part in name:
            name, shard = name.replace(hf_part, vllm_part, 1), shard_id
    return name, shard


class _Tracked:
    """The stream, recording which vLLM parameters (and stacked shards) it reached."""

    def __init__(self, stream: Iterable[tuple[str, torch.Tensor]]):
        self.stream, self.targets, self.shards = stream, set(), {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.stream:
            target, shard = vllm_target(name)
            self.targets.add(target)
            if shard is not None:
                self.shards.setdefault(target, set()).add(shard)
            yield name, tensor
            del tensor

    def gaps(self, expected: list[str]) -> tuple[list[str], list[str]]:
        """(vLLM parameters no tensor reached, stacked parameters short of shards)."""
        missing = [name for name in expected if name not in self.targets]
        partial = [t for t, got in self.shards.items() if any(k in t and got != need for k, need in _SHARDS.items())]
        return missing, partial


def _parameter_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _reprocess_tied_head(model: torch.nn.Module) -> bool:
    """Run a tied lm_head's weight processing again (see the module docstring); True if there was one."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def push_weights(llm: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load full HF-named tensors into the running engine through vLLM's layerwise reload; raise if the
    stream left a parameter (or a shard of a stacked one) unloaded."""
    expected = llm.apply_model(_parameter_names)[0]
    tracked = _Tracked(named_tensors)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tracked), "is_checkpoint_format": True})
    llm.apply_model(_reprocess_tied_head)
    missing, partial = tracked.gaps(expected)
    if missing or partial:
        raise RuntimeError(f"weight push left vLLM parameters unloaded: {missing[:8]} (of {len(missing)}); "
                           f"stacked parameters missing shards: {partial[:8]}")

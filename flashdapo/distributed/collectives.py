"""The few collectives flashdapo uses, in one place: identity without a process group (or with one rank).

A reduction travels on the device its backend needs: NCCL reduces only CUDA tensors, so a host tensor is
copied to the current CUDA device and back; gloo (and the trainer's mixed "cpu:gloo,cuda:nccl" group,
which routes each tensor by its device) takes it where it is. Callers pass and get back tensors on their
own device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_objects", "all_reduce", "barrier", "broadcast_object", "world_size"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in `group` (the default group when None); 1 without an initialized process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A reduced copy of `tensor` over the ranks of `group` (sum / max / min); a copy at world size 1."""
    if world_size(group) == 1:
        return tensor.clone()
    on_nccl = dist.get_backend(group) == "nccl" and tensor.device.type != "cuda"
    work = tensor.detach().to(torch.device("cuda", torch.cuda.current_device()) if on_nccl else tensor.device,
                              copy=True)
    dist.all_reduce(work, op=_OPS[op], group=group)
    return work.to(tensor.device)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (pickled; for small host-side data only)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (pickled; for small host-side data only)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait for every rank (no-op at world size 1)."""
    if world_size() > 1:
        dist.barrier()

"""The torchrun environment, read in one place: rank, device, process group and meshes.

One code path for 1 and N ranks: a plain `flashdapo train` (no torchrun) starts a single-rank gloo
group, so FSDP2 and every collective (`flashdapo.distributed.collectives`) run the same way at any world size.

With sequence parallelism (`trainer.sequence_parallel` = sp) the ranks form a 2-D mesh dp x sp: the sp
consecutive ranks of a row are one sequence-parallel group and share one data-parallel slot (they train on
the same micro-batches, each on 1/sp of its tokens, `ulysses.py`). FSDP2 shards the parameters over all
dp x sp ranks (the flattened mesh, as torchtitan's dp_shard_cp): sharding over dp alone would keep sp
replicas of the weights, gradients and Adam moments (docs/architecture.md, the memory table). Gradients are
summed over every rank, which is the full gradient: each rank's loss covers disjoint tokens.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import FlashdapoError


@dataclass(frozen=True)
class DistEnv:
    """Who this process is: torchrun's RANK / LOCAL_RANK / WORLD_SIZE and the device it drives."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    """1-D mesh of every rank: FSDP2 shards over it."""
    sequence_parallel: int = 1
    """Ranks per sequence-parallel group (sp)."""
    sp_group: dist.ProcessGroup | None = None
    """This rank's sequence-parallel group (None when sp = 1)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Data-parallel slots: world size / sp."""
        return self.world_size // self.sequence_parallel

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel slot (its row of the dp x sp mesh)."""
        return self.rank // self.sequence_parallel

    @property
    def sp_rank(self) -> int:
        """This rank's position in its sequence-parallel group: which shard of the tokens it holds."""
        return self.rank % self.sequence_parallel


def init_distributed(device: str = "auto", timeout_s: int = 1800, sequence_parallel: int = 1) -> DistEnv:
    """Read the torchrun environment, pick the device, start the process group and the meshes.

    NCCL on CUDA, gloo on CPU (with a CPU device mesh). Without torchrun: one rank, a local store.
    `sequence_parallel` must divide the world size (SequenceParallelError otherwise).
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size % sequence_parallel:
        raise SequenceParallelError(f"trainer.sequence_parallel={sequence_parallel} must divide the world size "
                                    f"{world_size}: launch a multiple of {sequence_parallel} ranks or change it")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch.cuda.is_available() is False")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        # On GPUs, NCCL for CUDA tensors plus gloo for CPU ones: FSDP2 CPU offload keeps gradients (and
        # so the grad-norm all-reduce) on the CPU, and small host-side reductions need no device copy.
        backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                    device_id=dev if use_cuda else None)
        else:
            if world_size != 1:
                raise RuntimeError(f"WORLD_SIZE={world_size} but MASTER_ADDR is unset: launch with torchrun")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    mesh = init_device_mesh(dev.type, (world_size,), mesh_dim_names=("dp",))
    sp_group = None
    if sequence_parallel > 1:
        grid = init_device_mesh(dev.type, (world_size // sequence_parallel, sequence_parallel),
                                mesh_dim_names=("dp", "sp"))
        sp_group = grid.get_group("sp")
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=dev, mesh=mesh,
                   sequence_parallel=sequence_parallel, sp_group=sp_group)


class SequenceParallelError(FlashdapoError, ValueError):
    """trainer.sequence_parallel does not fit the world size or the model's attention heads."""


_BEFORE_DESTROY: list[Callable[[], None]] = []


def before_destroy(close: Callable[[], None]) -> None:
    """Run `close` in `shutdown`, after the final barrier and before the process group is destroyed: a
    co-located vLLM engine must stop while the group it shares still exists (its shutdown tears down
    its groups, and the default one with them)."""
    _BEFORE_DESTROY.append(close)


def shutdown(synchronize: bool = True) -> None:
    """Destroy the process group if one is up. On a clean exit ranks meet at a barrier first, so none
    tears its communicator down while another is still in a collective; after an error they do not
    (a barrier could hang on ranks stuck elsewhere). What `before_destroy` registered runs in between."""
    if dist.is_initialized() and synchronize and dist.get_world_size() > 1:
        dist.barrier()
    while _BEFORE_DESTROY:
        _BEFORE_DESTROY.pop()()
    if dist.is_initialized():
        dist.destroy_process_group()

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
from .roles import Bridges, Layout, connect_bridges, connect_store, init_partition


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
    role: str = "colocated"
    """colocated (every rank generates and trains), or in split placement trainer or rollout (`roles.py`).
    In split placement `rank`, `world_size` and `mesh` are this rank's side's (its partition rank and size):
    the default process group is the side's own, so FSDP2 and every collective see that side alone."""
    global_rank: int | None = None
    """The rank in the whole launch (torchrun's RANK); None: `rank` is."""
    global_world_size: int | None = None
    """Ranks in the whole launch; None: `world_size` is."""
    bridges: Bridges | None = None
    """Split placement: the links to the other side (`roles.py`)."""

    @property
    def is_main(self) -> bool:
        """The rank that logs and writes the run's files: rank 0 (in split placement trainer rank 0)."""
        return self.rank == 0 and self.role != "rollout"

    @property
    def partition_rank(self) -> int:
        """This rank's rank on its side (= rank)."""
        return self.rank

    @property
    def partition_size(self) -> int:
        """Ranks on this rank's side (= world_size)."""
        return self.world_size

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


def init_distributed(device: str = "auto", timeout_s: int = 1800, sequence_parallel: int = 1,
                     rollout_ranks: int = 0) -> DistEnv:
    """Read the torchrun environment, pick the device, start the process group and the meshes.

    NCCL on CUDA, gloo on CPU (with a CPU device mesh). Without torchrun: one rank, a local store.
    `sequence_parallel` must divide the world size (SequenceParallelError otherwise). `rollout_ranks` > 0:
    split placement, the last R ranks generate (`roles.py`): each side gets its own default group, and the
    bridges between them are built.
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if rollout_ranks:
        return _init_split(device, timeout_s, sequence_parallel, rollout_ranks, rank, local_rank, world_size)
    if world_size % sequence_parallel:
        raise SequenceParallelError(
            f"trainer.sequence_parallel={sequence_parallel} must divide the world size "
            f"{world_size}: launch a multiple of {sequence_parallel} ranks or change it")
    dev = _device(device, local_rank)
    use_cuda = dev.type == "cuda"
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
    mesh, sp_group = _meshes(dev, world_size, sequence_parallel)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=dev, mesh=mesh,
                   sequence_parallel=sequence_parallel, sp_group=sp_group)


def _device(device: str, local_rank: int) -> torch.device:
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch.cuda.is_available() is False")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    return dev


def _meshes(dev: torch.device, world_size: int, sequence_parallel: int):
    """The 1-D mesh of every rank of the default group, and this rank's sp group (None when sp = 1)."""
    mesh = init_device_mesh(dev.type, (world_size,), mesh_dim_names=("dp",))
    sp_group = None
    if sequence_parallel > 1:
        grid = init_device_mesh(dev.type, (world_size // sequence_parallel, sequence_parallel),
                                mesh_dim_names=("dp", "sp"))
        sp_group = grid.get_group("sp")
    return mesh, sp_group


def _init_split(device: str, timeout_s: int, sequence_parallel: int, rollout_ranks: int, rank: int,
                local_rank: int, world_size: int) -> DistEnv:
    """Split placement: this rank's side as the default group, then the bridges (`roles.py`)."""
    if "MASTER_ADDR" not in os.environ or rollout_ranks >= world_size:
        raise RuntimeError(f"split placement needs a torchrun launch of more than rollout.rollout_ranks="
                           f"{rollout_ranks} ranks (WORLD_SIZE={world_size})")
    layout = Layout(trainers=world_size - rollout_ranks, rollouts=rollout_ranks)
    dev = _device(device, local_rank)
    store = connect_store()
    role = layout.role(rank)
    sp = sequence_parallel if role == "trainer" else 1  # the rollout side trains nothing
    if layout.partition(rank)[2] % sp:
        raise SequenceParallelError(
            f"trainer.sequence_parallel={sp} must divide the {layout.trainers} trainer "
            f"ranks: launch a multiple of {sp} trainer ranks or change it")
    backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    _, part_rank, part_size = init_partition(layout, rank, store, backend, timeout_s,
                                             dev if dev.type == "cuda" else None)
    mesh, sp_group = _meshes(dev, part_size, sp)
    bridges = connect_bridges(layout, rank, store, dev, timeout_s)
    return DistEnv(rank=part_rank, local_rank=local_rank, world_size=part_size, device=dev, mesh=mesh,
                   sequence_parallel=sp, sp_group=sp_group, role=role, global_rank=rank,
                   global_world_size=world_size, bridges=bridges)


class SequenceParallelError(FlashdapoError, ValueError):
    """trainer.sequence_parallel does not fit the world size or the model's attention heads."""


class ExpertParallelError(FlashdapoError, ValueError):
    """trainer.expert_parallel does not fit the world size or the model's experts."""


def expert_parallel_mesh(env: DistEnv, expert_parallel: int) -> DeviceMesh:
    """The 2-D mesh ("efsdp", "ep") of expert parallelism over env's ranks (models/moe/expert_parallel.py).

    An expert-parallel group is `expert_parallel` = E consecutive ranks (the same rank // E; on GPUs one
    node's, so the token all-to-all stays on its fast links): each holds 1/E of every MoE layer's experts.
    "efsdp" joins the ranks that hold the same experts (the same rank % E): FSDP2 shards those experts over it
    and sums their gradients over it. E divides the world size (all dp x sp ranks: the token exchange is per
    token, so the ranks of a sequence-parallel group may share experts too); ExpertParallelError otherwise."""
    if expert_parallel < 1 or env.world_size % expert_parallel:
        raise ExpertParallelError(
            f"trainer.expert_parallel={expert_parallel} must divide the data-parallel world "
            f"size {env.world_size} (trainer ranks): launch a multiple of {expert_parallel} "
            "ranks or change it")
    return init_device_mesh(env.device.type, (env.world_size // expert_parallel, expert_parallel),
                            mesh_dim_names=("efsdp", "ep"))


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

"""Expert parallelism's token all-to-all (models/moe/expert_parallel.py) in a training step: bytes that
leave one rank, and their time over the GPU's links.

Bytes (modelled: routing assumed balanced, every expert rank receiving its share). In each MoE layer a
rank's T tokens go to their top_k experts: T x top_k rows of H values, (E - 1) / E of them to the other
E - 1 ranks of its expert-parallel group (dispatch), and as many come back (combine): per layer and forward
2 T top_k H b (E - 1) / E bytes, b = the compute dtype's bytes. A backward runs both exchanges in reverse
(as many bytes again), and with activation checkpointing the recomputed forward exchanges once more. The
old log-probs' forward (when the trainer computes them) is one more forward.

Time (modelled): the bytes at the links' datasheet rate per direction, no overlap with compute (the
exchange sits between the router and the experts). An expert-parallel group is E consecutive ranks
(distributed/mesh.py), so with E <= GPUs per node its peers share the rank's node: NVLink; peers on other
nodes are reached at the network's rate (`NETWORK_GBPS`, an assumption: one 400 Gb/s NIC per GPU), and the
slower share sets the time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels.gpus import GPU
from .model import ModelShape


@dataclass(frozen=True)
class Links:
    """A GPU's links: GB/s per direction (the datasheet's bidirectional NVLink figure halved)."""

    nvlink_gbps: float
    network_gbps: float
    source: str


NETWORK_GBPS = 50.0
"""Inter-node GB/s per GPU per direction: one 400 Gb/s InfiniBand/RoCE NIC per GPU (assumed, not measured)."""

LINKS: dict[str, Links] = {
    "h20": Links(450.0, NETWORK_GBPS, "NVIDIA H20 datasheet: NVLink 900 GB/s"),
    "h100": Links(450.0, NETWORK_GBPS, "NVIDIA H100 datasheet (SXM5): NVLink 900 GB/s"),
    "h200": Links(450.0, NETWORK_GBPS, "NVIDIA H200 datasheet (SXM): NVLink 900 GB/s"),
    "a100": Links(300.0, NETWORK_GBPS, "NVIDIA A100 datasheet (80GB SXM): NVLink 600 GB/s"),
}
"""Per GPU of the table (kernels/gpus.py), by its `--gpu` key."""


def links_of(gpu: GPU) -> Links:
    """`gpu`'s links (a GPU missing here: PCIe Gen5 x16's 64 GB/s within a node, assumed)."""
    return LINKS.get(gpu.key, Links(64.0, NETWORK_GBPS, "assumed: PCIe Gen5 x16, 64 GB/s"))


def forward_exchanges(checkpointing: bool, ppo_epochs: int, old_logprobs: bool) -> int:
    """Forward-equivalents of all-to-all traffic in one step: per PPO epoch a forward and its backward (2), a
    recompute with activation checkpointing (1); plus the old log-probs' forward when the trainer runs it."""
    return ppo_epochs * (3 if checkpointing else 2) + (1 if old_logprobs else 0)


def all_to_all_bytes(shape: ModelShape, tokens: float, expert_parallel: int, compute_bytes: int,
                     forwards: int) -> float:
    """Bytes leaving one rank of `tokens` tokens over `forwards` forward-equivalents (dispatch + combine in
    every MoE layer; module docstring). 0 for a dense model or expert_parallel 1."""
    moe = shape.moe
    if moe is None or expert_parallel == 1:
        return 0.0
    per_forward = 2 * tokens * moe.top_k * shape.hidden * compute_bytes * (expert_parallel -
                                                                           1) / expert_parallel
    return per_forward * moe.moe_layers * forwards


def all_to_all_seconds(sent: float, expert_parallel: int, gpus_per_node: int, links: Links) -> float:
    """Seconds to send `sent` bytes from one rank to the other E - 1 of its group, evenly: the peers on its
    node over NVLink, the rest over the network (the slower share sets the time)."""
    if sent == 0 or expert_parallel == 1:
        return 0.0
    per_node = gpus_per_node or expert_parallel
    local_peers = min(expert_parallel, per_node) - 1
    remote_peers = expert_parallel - 1 - local_peers
    share = sent / (expert_parallel - 1)
    return max(share * local_peers / (links.nvlink_gbps * 1e9),
               share * remote_peers / (links.network_gbps * 1e9))


__all__ = ["LINKS", "Links", "NETWORK_GBPS", "all_to_all_bytes", "all_to_all_seconds", "forward_exchanges",
           "links_of"]

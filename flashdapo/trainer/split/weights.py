"""Split placement's weights: the trainer pushes every version the schedule will ask for, the rollout side
stages them and loads the one each batch needs.

The choices, before the code:

- **Eager push, no trainer thread.** After step s (and once at the start for the starting weights) every
  trainer rank walks `iter_full_state_dict` (FSDP2 all-gathers: a collective over the trainer side only);
  trainer rank 0 packs the full tensors into buckets of at most BUCKET_BYTES (consecutive tensors of one
  dtype, flattened) and broadcasts each over the weights bridge. Before the buckets it writes the version's
  header into the store: the push check's probe log-probs and every tensor's float64 sum.
- **A receiver thread on each rollout rank** polls for the next version's header, joins the broadcasts and
  stages the version on the host. The strict schedule bounds what is staged: when the trainer pushes θ_s it
  has received batch s, so the rollout side is generating batch s+1 with θ_(s-k) and holds θ_(s-k) .. θ_s,
  k + 1 versions; the receiver is therefore always ready and the trainer's broadcast never waits for a
  generation (`Stage.max_staged` records the bound a test asserts).
- **Loading** is the main rollout thread's, at the batch boundary only: the full tensors are cut into this
  rank's FSDP2 shards (no collective) and copied into the rollout side's policy. Then the push check: the
  rollout policy's log-probs of the fixed probe tokens against the trainer's for the same version; beyond the
  tolerance the error names the tensors whose sums differ (a perturbed or stale tied head is named).
- The pushed dtype is the policy's own (fp32 master weights): the rollout side's forward is then the
  trainer's, which is what makes lag 0 equal the co-located run bitwise.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ...distributed.collectives import all_reduce
from ...distributed.mesh import DistEnv
from ...distributed.roles import Bridges
from ...models.weights import hf_name, iter_full_state_dict, named_tensors
from ..observe.logprob_check import PUSH_TOLERANCE, PushCheck, PushMismatchError

BUCKET_BYTES = 256 << 20
"""Bytes per broadcast bucket: bounds trainer rank 0's staging copy (one bucket, not the model)."""

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool,
                               torch.uint8, torch.float64)}


@dataclass
class PushStats:
    """What one push cost on the trainer side."""

    seconds: float = 0.0
    bytes: int = 0


def _buckets(entries: list[tuple[str, list[int], str]]) -> list[list[int]]:
    """Indices of the manifest's tensors per bucket: consecutive, one dtype, at most BUCKET_BYTES (or one tensor)."""
    out, size, dtype = [], 0, None
    for i, (_, shape, dt) in enumerate(entries):
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=_DTYPES[dt]).element_size()
        if out and dt == dtype and size + nbytes <= BUCKET_BYTES:
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size, dtype = nbytes, dt
    return out


def push_weights(policy, env: DistEnv, version: int, check: PushCheck) -> PushStats:
    """Every trainer rank: gather θ_version; trainer rank 0 broadcasts it to the rollout side (module docstring)."""
    start = time.perf_counter()
    probe = torch.cat(check.trainer_logprobs(check.probe))  # every trainer rank: a forward over the FSDP2 shards
    tensors = list(iter_full_state_dict(policy.hf))
    if env.rank != 0:
        return PushStats(time.perf_counter() - start, 0)
    bridges: Bridges = env.bridges
    manifest = [(name, list(t.shape), str(t.dtype)) for name, t in tensors]
    header = {"manifest": manifest, "probe": probe.tolist(),
              "sums": [t.double().sum().item() for _, t in tensors]}
    bridges.set(f"weights/{version}/header", json.dumps(header))
    sent = 0
    for bucket in _buckets(manifest):
        flat = torch.cat([tensors[i][1].reshape(-1) for i in bucket])
        bridges.broadcast_weights(flat)
        sent += flat.numel() * flat.element_size()
    return PushStats(time.perf_counter() - start, sent)


@dataclass
class StagedVersion:
    tensors: dict[str, torch.Tensor]
    probe: torch.Tensor
    sums: dict[str, float]


@dataclass
class Stage:
    """The rollout rank's staged versions, filled by the receiver thread (`start`), read by `take`."""

    bridges: Bridges
    last_version: int
    """The newest version the trainer will push (no receive past it)."""
    first_version: int = 0
    staged: dict[int, StagedVersion] = field(default_factory=dict)
    max_staged: int = 0
    received_bytes: int = 0
    error: BaseException | None = None
    _ready: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._receive_all, name="flashdapo-weights", daemon=True)
        self._thread.start()

    def _receive_all(self) -> None:
        try:
            for version in range(self.first_version, self.last_version + 1):
                staged = self._receive(version)
                with self._ready:
                    self.staged[version] = staged
                    self.max_staged = max(self.max_staged, len(self.staged))
                    self._ready.notify_all()
        except BaseException as err:  # reported by `take` on the main thread (fail-fast ends the job)
            with self._ready:
                self.error = err
                self._ready.notify_all()

    def _receive(self, version: int) -> StagedVersion:
        b = self.bridges
        b.wait_key(f"weights/{version}/header", [0], f"the weights of step {version}")
        header = json.loads(b.get(f"weights/{version}/header"))
        manifest = header["manifest"]
        out: dict[str, torch.Tensor] = {}
        for bucket in _buckets(manifest):
            dtype = _DTYPES[manifest[bucket[0]][2]]
            numels = [torch.Size(manifest[i][1]).numel() for i in bucket]
            flat = torch.empty(sum(numels), dtype=dtype)
            b.broadcast_weights(flat)
            self.received_bytes += flat.numel() * flat.element_size()
            for i, part in zip(bucket, flat.split(numels)):
                out[manifest[i][0]] = part.view(manifest[i][1])
        names = [m[0] for m in manifest]
        return StagedVersion(out, torch.tensor(header["probe"]), dict(zip(names, header["sums"])))

    def take(self, version: int) -> tuple[StagedVersion, float]:
        """Version `version` (waiting for it), dropping every older one; and the seconds waited."""
        start = time.perf_counter()
        with self._ready:
            while version not in self.staged and self.error is None:
                self._ready.wait(0.5)
            if self.error is not None:
                raise self.error
            for old in [v for v in self.staged if v < version]:
                del self.staged[old]
            return self.staged[version], time.perf_counter() - start

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


@torch.no_grad()
def load_weights(policy, staged: StagedVersion) -> None:
    """Copy a staged version's full tensors into this rank's (FSDP2-sharded) policy: each cut to its shard."""
    for raw, value in named_tensors(policy.hf):
        full = staged.tensors[hf_name(raw)]
        if isinstance(value, DTensor):
            shard = distribute_tensor(full.to(value.dtype), value.device_mesh, value.placements, src_data_rank=None)
            value.to_local().copy_(shard.to_local())
        else:
            value.copy_(full)


def check_loaded(policy, staged: StagedVersion, check: PushCheck, version: int) -> float:
    """The push check on the rollout side: this policy's probe log-probs against the trainer's for `version`;
    raises PushMismatchError naming the tensors whose sums differ. The max difference."""
    mine = torch.cat(check.trainer_logprobs(check.probe))
    worst = all_reduce(torch.tensor([(mine - staged.probe).abs().max().item()], dtype=torch.float64), "max").item()
    tolerance = PUSH_TOLERANCE[torch.float32]
    if not worst <= tolerance:
        differ = [name for name, value in _loaded_sums(policy) if abs(value - staged.sums[name]) > 1e-6 *
                  max(1.0, abs(staged.sums[name]))]
        raise PushMismatchError(
            f"after loading the weights of step {version} the rollout side's log-probs of {mine.numel()} fixed tokens "
            f"differ from the trainer's by {worst:.3g} max, beyond {tolerance}; tensors that differ: "
            f"{', '.join(differ) or 'none (the forward itself differs)'}")
    return worst


def _loaded_sums(policy) -> Iterator[tuple[str, float]]:
    for name, value in iter_full_state_dict(policy.hf):
        yield name, value.double().sum().item()


__all__ = ["BUCKET_BYTES", "PushStats", "Stage", "StagedVersion", "check_loaded", "load_weights", "push_weights"]

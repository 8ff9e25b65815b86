"""Checkpoints that survive a crash, and the final HF export.

A checkpoint is a directory `checkpoints/step_XXXXXXXX/` holding a `torch.distributed.checkpoint`
(DCP) save of model + optimizer (sharded, so it reloads at any world size), `trainer_state.pt` (step,
LR schedule, data position), one `rng_rank{r}.pt` per rank (torch, CUDA, numpy, python), and a
`COMPLETE` marker. It is written under `step_XXXXXXXX.tmp/` and renamed into place only once every
rank has finished, so a crash mid-save never leaves a directory that `--resume auto` would pick.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .distributed import DistEnv, barrier, broadcast_object

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint path that cannot be resumed from; the message says why."""


@dataclass
class TrainerState:
    """Everything besides weights and optimizer that a resumed run needs to continue identically."""

    step: int
    scheduler: dict[str, Any]
    sampler: dict[str, Any]


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainerState, keep_last: int) -> Path:
    """Write the checkpoint of `state.step` atomically (tmp dir + rename) and prune old ones."""
    final = checkpoint_root(run_dir) / f"step_{state.step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{env.rank}.pt")
    if env.is_main:
        torch.save(state, tmp / "trainer_state.pt")
    barrier()
    if env.is_main:
        marker = {"step": state.step, "world_size": env.world_size, "time": time.time()}
        _write_synced(tmp / MARKER, json.dumps(marker))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(checkpoint_root(run_dir), keep_last)
    barrier()
    return final


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _prune(root: Path, keep_last: int) -> None:
    complete = sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and _is_complete(p))
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / ".metadata").is_file() and (path / "trainer_state.pt").is_file()


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint under run_dir (temporary or unmarked directories never count)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None
    candidates = sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and _is_complete(p))
    return candidates[-1] if candidates else None


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """'' -> None (fresh); 'auto' -> newest complete checkpoint or None; a path -> that checkpoint,
    validated, with an error naming what is missing."""
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.resume={resume}: no such directory")
    missing = [name for name in (MARKER, ".metadata", "trainer_state.pt") if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint.resume={resume}: not a complete flashdapo checkpoint "
                              f"(missing {', '.join(missing)}); an interrupted save leaves such a directory")
    return path


def load_checkpoint(path: Path, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Load weights, optimizer, RNG (this rank's, else rank 0's at another world size) and the state."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state_dict = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state_dict, checkpoint_id=str(path))
    except Exception as err:  # DCP raises several types for unreadable/corrupt files
        raise CheckpointError(f"checkpoint {path}: cannot load model/optimizer: {err}") from err
    set_state_dict(model, optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
    rng_file = path / f"rng_rank{env.rank}.pt"
    if not rng_file.is_file():
        rng_file = path / "rng_rank0.pt"
    _set_rng_state(torch.load(rng_file, weights_only=False))
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    return broadcast_object(state)


def export_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], hf_config, tokenizer, out_dir: Path,
              is_main: bool, shard_bytes: int = 2 << 30) -> None:
    """Write an HF-format model directory (sharded safetensors + index, config, tokenizer).

    `named_tensors` yields full tensors one at a time on every rank (gathered from FSDP2 shards);
    rank 0 buffers at most `shard_bytes` on CPU before writing a file, never a whole second copy.
    """
    from safetensors.torch import save_file

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    files: list[dict[str, torch.Tensor]] = [{}]
    weight_map: dict[str, int] = {}
    buffered = 0
    for name, tensor in named_tensors:
        if not is_main:
            continue
        if buffered and buffered + tensor.numel() * tensor.element_size() > shard_bytes:
            _flush(files, tmp, save_file)
            buffered = 0
        files[-1][name] = tensor.detach().to("cpu", copy=True).contiguous()
        weight_map[name] = len(files) - 1
        buffered += tensor.numel() * tensor.element_size()
    if is_main:
        _finish_export(files, weight_map, tmp, out_dir, hf_config, tokenizer, save_file)
    barrier()


def _shard_name(index: int, total: int) -> str:
    return "model.safetensors" if total == 1 else f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def _flush(files: list[dict[str, torch.Tensor]], tmp: Path, save_file) -> None:
    save_file(files[-1], str(tmp / f"part-{len(files) - 1:05d}.safetensors"), metadata={"format": "pt"})
    files[-1] = {}  # written; keep the slot so indices stay stable
    files.append({})


def _finish_export(files, weight_map, tmp: Path, out_dir: Path, hf_config, tokenizer, save_file) -> None:
    if files[-1]:
        save_file(files[-1], str(tmp / f"part-{len(files) - 1:05d}.safetensors"), metadata={"format": "pt"})
    else:
        files.pop()
    total = len(files)
    for i in range(total):
        (tmp / f"part-{i:05d}.safetensors").rename(tmp / _shard_name(i, total))
    if total > 1:
        index = {"metadata": {}, "weight_map": {k: _shard_name(v, total) for k, v in weight_map.items()}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)

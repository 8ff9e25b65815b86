"""The settings that shape a run, recorded in each checkpoint and compared when a run resumes.

A resumed run must continue the run that wrote the checkpoint, not splice a second one onto it. So every
checkpoint records, as a flat `{field path: plain value}` dict (`trainer_state.pt`, key `settings`):

- the model: its class (`model.architecture`), the shape fields of its HF config (`model.config.*`), the
  names and shapes of its parameters (`model.parameters`, a hash: catches a dropped bias), the fields of its
  HF config that change the function the same weights compute (`model.function.*`: rope, norm epsilon, windows
  and layer types, softcaps, activation, routing; the family registry's `function_keys`, models/hf.py) and
  `model.dtype`;
- the tokenizer: a hash of its vocabulary (`tokenizer.vocab`), its special ids, a hash of its chat template;
- the training data: each train file's content hash (`data.train_files`, sha256 of the bytes, in order; a
  file with the same rows in another order or with one answer changed differs), the prompt budget and
  truncation, dedup and shuffle; the built-in task and its settings when there are no train files;
- the batch geometry (`trainer.train_batch`, `gen_batch`, `mini_batch`, `ppo_epochs`, `seed`), the group
  size and sampling of the rollouts (`rollout.n`, `temperature`, `top_p`, `top_k`, `max_response_length`,
  and how they are collected: `streaming`, `max_in_flight`, `partial_rollouts`, `max_carry_steps`,
  `agree_every`; the placement, and in split placement the rollout ranks R and the lag k: `rollout_ranks`,
  `max_lag`),
  and every field of the `algorithm` and `optim` sections;
- LoRA: every field of the `lora` section (rank 0 when off), and the base the adapters were trained on
  (`lora.base`: each safetensors file's name, size and a hash of its first and last MiB; the base is not in
  the checkpoint, so resuming adapters onto another one would splice two runs).

Not recorded, free to change on resume: total_steps, validation (files, k, intervals), logging, checkpoint
intervals, devices and world size, kernels and micro-batch sizes (numerics only), the rollout engine.

A resume whose settings differ is refused with one line naming each field `old -> new`, unless
`checkpoint.allow_changes` lists it (a field path, or a section such as `optim` for all its fields); the
model's architecture and shapes cannot be allowed (the weights would not fit the new model), its function
fields can (`model.function.rope_parameters`, or `model.function` for all: a deliberate change of rope
scaling, say). A setting the checkpoint does not record (one written before flashdapo recorded it) is unknown,
not changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ...config import Config
from ...errors import FlashdapoError
from ...models.hf import config_keys, function_keys
from ...tokenizer import eos_token_ids

FIXED_PREFIXES = ("model.architecture", "model.config.", "model.parameters")
"""Settings checkpoint.allow_changes cannot allow: the checkpoint's weights only fit the model they came
from."""

_TRAINER_FIELDS = ("train_batch", "gen_batch", "mini_batch", "ppo_epochs", "seed")
_ROLLOUT_FIELDS = ("n", "temperature", "top_p", "top_k", "max_response_length", "streaming", "max_in_flight",
                   "partial_rollouts", "max_carry_steps", "agree_every")
_SPLIT_FIELDS = ("rollout_ranks", "max_lag")
"""Recorded in split placement only (co-located runs ignore them)."""
_DATA_FIELDS = ("max_prompt_length", "truncation", "dedup", "shuffle")


class ResumeRefused(FlashdapoError, RuntimeError):
    """A resume that would splice two runs (changed settings, another run's checkpoint); never skipped
    over."""


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks (constant memory whatever the file size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _sha(value: Any) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _plain(value: Any) -> Any:
    """JSON-like values (tuples become lists), so that a stored and a fresh record compare equal."""
    return json.loads(json.dumps(value))


def model_settings(hf_model, dtype: str) -> dict[str, Any]:
    """The model's class, shape fields, parameter names/shapes (global shapes under FSDP2) and function
    fields."""
    config = hf_model.config
    shapes = [[name, list(p.shape)] for name, p in hf_model.named_parameters()]
    found = {
        f"model.config.{key}": getattr(config, key)
        for key in config_keys(config) if hasattr(config, key)
    }
    function = {
        f"model.function.{key}": getattr(config, key)
        for key in function_keys(config) if hasattr(config, key)
    }
    return {
        "model.architecture": type(hf_model).__name__, **found, "model.parameters": _sha(shapes),
        **function, "model.dtype": dtype
    }


def tokenizer_settings(tokenizer) -> dict[str, Any]:
    """Hashes of the vocabulary and chat template, and the special ids (readable)."""
    specials = {"pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "eos": eos_token_ids(tokenizer)}
    return {"tokenizer.vocab": _sha(sorted(tokenizer.get_vocab().items())),
            "tokenizer.special_ids": specials,
            "tokenizer.chat_template": _sha(getattr(tokenizer, "chat_template", None))}


def run_settings(cfg: Config, hf_model, tokenizer) -> dict[str, Any]:
    """Everything that shapes this run (module docstring), as `{field path: plain value}`."""
    data = cfg.data
    found: dict[str, Any] = {**model_settings(hf_model, cfg.model.dtype), **tokenizer_settings(tokenizer)}
    if data.train_files:
        found["data.train_files"] = ["sha256:" + file_sha256(f) for f in data.train_files]
    else:
        task = getattr(data, data.task)  # the built-in task's section (data.toy, data.scratchpad)
        found["data.task"] = data.task
        found.update({f"data.{data.task}.{k}": v for k, v in asdict(task).items()})
    found.update({f"data.{k}": getattr(data, k) for k in _DATA_FIELDS})
    found.update({f"trainer.{k}": getattr(cfg.trainer, k) for k in _TRAINER_FIELDS})
    found.update({f"rollout.{k}": getattr(cfg.rollout, k) for k in _ROLLOUT_FIELDS})
    found["rollout.placement"] = cfg.rollout.placement
    # which weights sampled which batch: the run's numbers depend on them
    if cfg.rollout.placement == "split":
        found.update({f"rollout.{k}": getattr(cfg.rollout, k) for k in _SPLIT_FIELDS})
    found.update({f"algorithm.{k}": v for k, v in asdict(cfg.algorithm).items()})
    found.update({f"optim.{k}": v for k, v in asdict(cfg.optim).items()})
    found.update({f"lora.{k}": v for k, v in asdict(cfg.lora).items()})
    if cfg.lora.enabled and cfg.model.path:
        found["lora.base"] = weights_fingerprint(cfg.model.path)
    return _plain(found)


def weights_fingerprint(model_dir: str | Path, window: int = 1 << 20) -> str:
    """A hash of a checkpoint's weight files, quick at any size: each *.safetensors file's name, size, and
    the sha256 of its first and last `window` bytes (its header and the start and end of its tensors)."""
    parts = []
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        size = file.stat().st_size
        digest = hashlib.sha256()
        with file.open("rb") as f:
            digest.update(f.read(window))
            f.seek(max(size - window, 0))
            digest.update(f.read(window))
        parts.append([file.name, size, digest.hexdigest()])
    return _sha(parts)


def _allows(entry: str, path: str) -> bool:
    return path == entry or path.startswith(entry + ".")


def compare_settings(old: dict[str, Any], new: dict[str, Any], allowed: Sequence[str],
                     where: Path) -> list[tuple[str, Any, Any]]:
    """The changes from `old` (the checkpoint's) to `new` (this run's) that `allowed` accepts; raises
    ResumeRefused naming every other change `old -> new`. A setting the checkpoint does not record (a newer
    flashdapo records more) is not compared."""
    for entry in allowed:
        if not any(_allows(entry, path) for path in new):
            raise ResumeRefused(f"checkpoint.allow_changes: {entry!r} names no recorded setting; recorded: "
                                f"{', '.join(sorted({p.split('.')[0] for p in new}))} and their fields, e.g. "
                                "optim.lr, trainer.train_batch, data.train_files")
        if any(_allows(entry, path) and path.startswith(FIXED_PREFIXES) for path in new):
            raise ResumeRefused(
                f"checkpoint.allow_changes: {entry!r} cannot be allowed: a checkpoint's weights "
                "only fit the model architecture and shapes they were trained in")
    changes = [(path, old[path], value) for path, value in new.items() if path in old and old[path] != value]
    refused = [c for c in changes if not any(_allows(entry, c[0]) for entry in allowed)]
    if refused:
        fixed = [path for path, _, _ in refused if path.startswith(FIXED_PREFIXES)]
        allowable = [path for path, _, _ in refused if path not in fixed]
        # Only suggest what checkpoint.allow_changes would accept: never a fixed field.
        accept = (f", or accept the change with --checkpoint.allow-changes {' '.join(allowable)}"
                  if allowable and not fixed else "")
        cannot = (f" ({', '.join(fixed)} cannot be allowed: the checkpoint's weights only fit the model "
                  "architecture and shapes they were trained in)" if fixed else "")
        raise ResumeRefused(
            f"cannot resume from {where}: this run's settings differ from the checkpoint's, and resuming "
            "would "
            f"splice two runs: {describe_changes(refused)}{cannot}. Restore them, or start a fresh run "
            "(another "
            f"--logging.run-dir, or --logging.move-old-run true){accept}")
    return changes


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """`path old -> new; ...` for the log line of an accepted change."""
    return "; ".join(f"{path} {_show(a)} -> {_show(b)}" for path, a, b in changes)

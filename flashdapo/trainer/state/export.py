"""The final HF export: a model directory that `transformers` and vLLM load as they load any checkpoint.

Sharded safetensors (+ index), config (with `architectures`) and tokenizer, built in `export.tmp/` and its
files then moved into `export/`, replacing only the previous export's files (listed in
`export/.flashdapo-export.json`): a user's own files there are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from ...distributed.collectives import barrier

EXPORT_MANIFEST = ".flashdapo-export.json"
"""In export/: the files the export wrote (a re-export replaces these and leaves every other file)."""


def export_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], hf_config, tokenizer, out_dir: Path,
              is_main: bool, shard_bytes: int = 2 << 30, step: int | None = None) -> None:
    """Write an HF-format model directory (sharded safetensors + index, config, tokenizer).

    `named_tensors` yields full tensors one at a time on every rank (gathered from FSDP2 shards);
    rank 0 buffers at most `shard_bytes` on CPU before writing a file, never a whole second copy.
    `step`, the training step of the weights, is recorded in the manifest (`exported_step`).
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
        _finish_export(files, weight_map, tmp, out_dir, hf_config, tokenizer, save_file, step)
    barrier()


def exported_step(out_dir: Path) -> int | None:
    """The training step of the complete export in `out_dir` (its manifest's), None without one."""
    try:
        step = json.loads((out_dir / EXPORT_MANIFEST).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _shard_name(index: int, total: int) -> str:
    return "model.safetensors" if total == 1 else f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def _flush(files: list[dict[str, torch.Tensor]], tmp: Path, save_file) -> None:
    save_file(files[-1], str(tmp / f"part-{len(files) - 1:05d}.safetensors"), metadata={"format": "pt"})
    files[-1] = {}  # written; keep the slot so indices stay stable
    files.append({})


def _finish_export(files, weight_map, tmp: Path, out_dir: Path, hf_config, tokenizer, save_file,
                   step: int | None) -> None:
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
    if not getattr(hf_config, "architectures", None):  # what vLLM and AutoModel resolve the class from
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type]]
    hf_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _publish_export(tmp, out_dir, step)


def _publish_export(tmp: Path, out_dir: Path, step: int | None = None) -> None:
    """Move a finished export from `tmp` into `out_dir`, replacing the previous export's files and nothing else.

    The previous export's files are those its manifest (EXPORT_MANIFEST) lists; an export without one (an older
    flashdapo's) counts its weight files, model*.safetensors and their index. A user's own files stay. The
    manifest is removed first and written last, so an interrupted publish never claims a mixed directory."""
    written = sorted(p.name for p in tmp.iterdir())
    (tmp / EXPORT_MANIFEST).write_text(json.dumps({"files": written, "step": step}, indent=1) + "\n")
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    manifest = out_dir / EXPORT_MANIFEST
    try:
        previous = set(json.loads(manifest.read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        previous = {p.name for p in out_dir.glob("model*.safetensors")} | {"model.safetensors.index.json"}
    manifest.unlink(missing_ok=True)
    for name in previous - set(written):
        stale = out_dir / name
        if stale.is_file() and not stale.is_symlink():
            stale.unlink()
    for name in written:
        os.replace(tmp / name, out_dir / name)
    os.replace(tmp / EXPORT_MANIFEST, manifest)
    tmp.rmdir()

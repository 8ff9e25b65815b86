"""The final HF export: a model directory that `transformers` and vLLM load as they load any checkpoint.

Sharded safetensors (+ index), config (with `architectures`), generation config and tokenizer, built in
`export.tmp/` and its files then moved into `export/`, replacing only the previous export's files (listed in
`export/.flashdapo-export.json`): a user's own files there are kept.

What came with the source model directory (model.path) is exported as it came (docs/usage.md, checkpoints):
- **generation_config.json** is the source's file, byte for byte (its eos ids and sampling defaults: vLLM
  stops on its eos ids and samples with its defaults). A source without one exports none. The built-in toy
  model has no source: its export gets one written from the run's stop set (`eos_token_id`: the ids training
  stopped responses on, tokenizer.eos_token_ids) and its pad id, and no sampling defaults.
- **The tokenizer** is the source's files, copied byte for byte (`save_pretrained` would rewrite them:
  transformers 5 renames tokenizer_class, adds loader keys and re-serialises tokenizer.json), with no pad
  token added where the source had none (flashdapo's loader sets one again).
- **A chat template training used but the source's tokenizer lacks** (the plain template preflight gives a
  tokenizer without one) is written beside it as `flashdapo_chat_template.jinja`, named in the manifest, and
  not merged into tokenizer_config.json: the tokenizer stays the source's.
The toy task's tokenizer is built in memory: its export is `save_pretrained`'s.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from ...distributed.collectives import barrier
from ...models.moe.expert_layout import (
    FUSED,
    PER_EXPERT,
    checkpoint_expert_layout,
    fuse_experts,
    split_experts,
)
from ...tokenizer import eos_token_ids, loaded_from

EXPORT_MANIFEST = ".flashdapo-export.json"
"""In export/: the files the export wrote (a re-export replaces these and leaves every other file)."""

ADDED_CHAT_TEMPLATE = "flashdapo_chat_template.jinja"
"""In export/: the chat template training rendered prompts with, where the source's tokenizer has none (or
another): `tokenizer.chat_template = Path(export, ADDED_CHAT_TEMPLATE).read_text()`, or vLLM's
`--chat-template`."""

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "additional_chat_templates")
"""The files (and folder) a tokenizer directory may hold that transformers' tokenizer loading reads; with the
tokenizer class's own `vocab_files_names`, these are copied from the source when it has them."""


def export_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], hf_config, tokenizer, out_dir: Path,
              is_main: bool, shard_bytes: int = 2 << 30, step: int | None = None,
              source_dir: str | Path | None = None) -> None:
    """Write an HF-format model directory (sharded safetensors + index, config, generation config, tokenizer).

    `named_tensors` yields full tensors one at a time on every rank (gathered from FSDP2 shards);
    rank 0 buffers at most `shard_bytes` on CPU before writing a file, never a whole second copy.
    `step`, the training step of the weights, is recorded in the manifest (`exported_step`).
    `source_dir`: the model directory training started from, whose generation_config.json and tokenizer files
    are exported as they are (module docstring); None: the directory `tokenizer` was loaded from, if any.
    """
    from safetensors.torch import save_file

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    files: list[dict[str, torch.Tensor]] = [{}]
    weight_map: dict[str, int] = {}
    buffered = 0
    expert_source = source_dir if source_dir is not None else getattr(hf_config, "name_or_path", None)
    for name, tensor in in_source_expert_layout(named_tensors, expert_source):
        if not is_main:
            continue
        if buffered and buffered + tensor.numel() * tensor.element_size() > shard_bytes:
            _flush(files, tmp, save_file)
            buffered = 0
        files[-1][name] = tensor.detach().to("cpu", copy=True).contiguous()
        weight_map[name] = len(files) - 1
        buffered += tensor.numel() * tensor.element_size()
    if is_main:
        source = Path(source_dir) if source_dir is not None else source_of(tokenizer)
        _finish_export(files, weight_map, tmp, out_dir, hf_config, tokenizer, save_file, step, source)
    barrier()


def in_source_expert_layout(named_tensors: Iterable[tuple[str, torch.Tensor]],
                            source: str | Path | None) -> Iterable[tuple[str, torch.Tensor]]:
    """A MoE model's tensors in the expert layout of the checkpoint in `source` (the model directory training
    started from: `source_dir`, else the config's `name_or_path`): per-expert tensors when its safetensors
    hold per-expert ones (the Hub's Qwen3-MoE, DeepSeek-V3), fused ones when they hold fused ones
    (models/moe/expert_layout.py), so that the export is a drop-in replacement of its source. Without a source
    directory, or for a dense model, the stream as the model names it."""
    layout = checkpoint_expert_layout(source) if source and Path(source).is_dir() else None
    if layout == PER_EXPERT:
        return split_experts(named_tensors)
    if layout == FUSED:
        return fuse_experts(named_tensors)
    return named_tensors


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
                   step: int | None, source: Path | None) -> None:
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
    write_generation_config(tmp, source, tokenizer)
    added = write_tokenizer(tmp, source, tokenizer)
    publish_export(tmp, out_dir, step, added)


def write_generation_config(tmp: Path, source: Path | None, tokenizer) -> None:
    """generation_config.json: the source's, byte for byte; none for a source without one; for the toy model
    (no source), one with the run's stop set as `eos_token_id` and the pad id, and no sampling defaults."""
    if source is not None:
        if (source / "generation_config.json").is_file():
            shutil.copyfile(source / "generation_config.json", tmp / "generation_config.json")
        return
    from transformers import GenerationConfig

    stops = eos_token_ids(tokenizer)
    GenerationConfig(eos_token_id=stops[0] if len(stops) == 1 else stops,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)


def write_tokenizer(tmp: Path, source: Path | None, tokenizer) -> dict[str, str]:
    """The tokenizer: the source's tokenizer files copied as they are, else (a tokenizer built in memory)
    `save_pretrained`. A chat template training used that the source's tokenizer does not have goes beside
    them, in ADDED_CHAT_TEMPLATE. Returns {file: what it is} for the files added to the source's, for the
    manifest."""
    copied = copy_tokenizer_files(source, tmp, tokenizer) if source is not None else []
    if not copied:
        tokenizer.save_pretrained(tmp)
        return {}
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or template == _source_chat_template(source):
        return {}
    (tmp / ADDED_CHAT_TEMPLATE).write_text(template, encoding="utf-8")
    return {
        ADDED_CHAT_TEMPLATE: f"the chat template training rendered prompts with; the tokenizer of {source} "
        "has none (or another), and its files are exported unchanged"
    }


def copy_tokenizer_files(source: Path, tmp: Path, tokenizer) -> list[str]:
    """Copy the source's tokenizer files (TOKENIZER_FILES and the tokenizer class's vocab files) into `tmp`,
    byte for byte; returns their names ([] when the source has no tokenizer_config.json nor tokenizer.json,
    i.e. no tokenizer of its own)."""
    if not any((source / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        return []
    names = dict.fromkeys([*TOKENIZER_FILES, *(getattr(tokenizer, "vocab_files_names", None) or {}).values()])
    copied = []
    for name in names:
        path = source / name
        if path.is_dir() and not path.is_symlink():
            shutil.copytree(path, tmp / name)
        elif path.is_file():
            # a symlink (a hub cache's) is followed: the export holds the bytes
            shutil.copyfile(path, tmp / name)
        else:
            continue
        copied.append(name)
    return copied


def _source_chat_template(source: Path):
    """The chat template of the source's own tokenizer files (None without one, or when they do not load)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True).chat_template
    except (OSError, ValueError):
        return None


def source_of(tokenizer) -> Path | None:
    found = loaded_from(tokenizer)
    return Path(found) if found is not None else None


def publish_export(tmp: Path, out_dir: Path, step: int | None = None,
                    added: dict[str, str] | None = None) -> None:
    """Move a finished export from `tmp` into `out_dir`, replacing the previous export's files and nothing
    else.

    The previous export's files are those its manifest (EXPORT_MANIFEST) lists; an export without one (an
    older flashdapo's) counts its weight files, model*.safetensors and their index. A user's own files stay.
    The manifest is removed first and written last, so an interrupted publish never claims a mixed directory.
    `added`: files flashdapo wrote beside the source's (ADDED_CHAT_TEMPLATE), said in the manifest."""
    written = sorted(p.name for p in tmp.iterdir())
    manifest_text = {"files": written, "step": step, **({"added": added} if added else {})}
    (tmp / EXPORT_MANIFEST).write_text(json.dumps(manifest_text, indent=1) + "\n")
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
        if name in previous and (out_dir / name).is_dir() and not (out_dir / name).is_symlink():
            shutil.rmtree(out_dir / name)  # a folder the previous export wrote (additional_chat_templates/)
        os.replace(tmp / name, out_dir / name)
    os.replace(tmp / EXPORT_MANIFEST, manifest)
    tmp.rmdir()

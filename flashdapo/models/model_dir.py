"""A model directory (`model.path`, `flashdapo eval --model`) checked before anything loads it.

transformers' own errors for a wrong directory mislead ("install sentencepiece" for an empty one) or
omit the file ("header too large" without naming a corrupt safetensors shard), and safetensors reports a
file it may not read as "No such file or directory": a denied permission is named as such. This check names
the directory or file and what an HF checkpoint directory must hold: config.json, weights (*.safetensors or
*.bin), tokenizer files. It reads only the safetensors headers, not the tensors, and (without safetensors
weights) the pickles of pytorch_model*.bin memory-mapped, as transformers reads them (weights_only): a file
holding a pickled object is named, without torch's hint to load it unsafely.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import FlashdapoError, refused_pickle

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
EXPECTED = "an HF checkpoint directory (config.json, *.safetensors weights, tokenizer files)"


class ModelDirError(FlashdapoError, ValueError):
    """The model directory is missing, empty, or holds an unreadable file; the message names it."""


def _denied(path: Path, what: str = "read") -> ModelDirError:
    return ModelDirError(f"{path}: permission denied: the user running flashdapo may not {what} it; fix its "
                         "permissions (e.g. chmod a+r, a+x for a directory) or ownership")


def _check_readable(file: Path) -> None:
    try:
        with file.open("rb"):
            pass
    except PermissionError as err:
        raise _denied(file) from err


def check_model_dir(path: str | Path, field: str = "model.path") -> None:
    """Raise ModelDirError naming the directory or file when `path` is not a loadable HF checkpoint."""
    from safetensors import safe_open

    root = Path(path)
    where = f"{field}={root}"
    if not root.is_dir():
        raise ModelDirError(
            f"{where}: {'is a file, not' if root.exists() else 'no such'} directory; expected {EXPECTED}")
    try:
        entries = list(root.iterdir())
    except PermissionError as err:
        raise _denied(root, "list") from err
    if not entries:
        raise ModelDirError(f"{where}: the directory is empty; expected {EXPECTED}")
    config = root / "config.json"
    if not config.is_file():
        raise ModelDirError(f"{where}: no config.json; expected {EXPECTED}")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except PermissionError as err:
        raise _denied(config) from err
    except (ValueError, UnicodeDecodeError) as err:
        raise ModelDirError(f"{config}: not valid JSON ({err}); re-download or re-export the model") from err
    shards = sorted(root.glob("*.safetensors"))
    if not shards and not any(root.glob("*.bin")):
        raise ModelDirError(f"{where}: no weights (*.safetensors or *.bin); expected {EXPECTED}")
    for index in sorted(root.glob("*.index.json")):
        _check_index(index)
    for file in [
            *shards, *sorted(root.glob("*.bin")), *(root / n for n in TOKENIZER_FILES if (root / n).is_file())
    ]:
        _check_readable(file)  # safetensors reports a denied read as "No such file or directory"
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                f.keys()
        except Exception as err:  # safetensors raises its own SafetensorError (and OSError) for bad files
            raise ModelDirError(f"{shard}: not a readable safetensors file ({str(err).splitlines()[0]}); "
                                "re-download or re-export the model") from err
    if not shards:  # transformers loads these only where no safetensors weights are
        for file in sorted(root.glob("pytorch_model*.bin")):
            _check_bin(file)
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(
            f"{where}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); expected {EXPECTED}")


def _check_index(index: Path) -> None:
    """A sharded checkpoint's index (model.safetensors.index.json, pytorch_model.bin.index.json) whose
    weight_map names only files the directory holds: transformers would fail mid-load on the first missing
    one with a bare FileNotFoundError."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except PermissionError as err:
        raise _denied(index) from err
    except (ValueError, UnicodeDecodeError, AttributeError) as err:
        raise ModelDirError(f"{index}: not a shard index (a JSON object with a weight_map); re-download or "
                            "re-export the model") from err
    if not isinstance(weight_map, dict):
        raise ModelDirError(f"{index}: weight_map: expected an object of tensor name -> shard file, got "
                            f"{type(weight_map).__name__}; re-download or re-export the model")
    missing = sorted({str(f) for f in weight_map.values()} - {p.name for p in index.parent.iterdir()})
    if missing:
        raise ModelDirError(f"{index}: weight_map names shard {missing[0]}, which is not in {index.parent}"
                            + (f" ({len(missing)} shards missing)" if len(missing) > 1 else "")
                            + "; copy the whole checkpoint")


def _check_bin(file: Path) -> None:
    """A PyTorch weights file (pytorch_model*.bin) holds only tensors: read as transformers reads it,
    torch.load(weights_only=True), memory-mapped (the pickle is read, the tensors' bytes are not). A pickled
    object is refused in one line naming the file; torch's hint to pass weights_only=False (which would run
    it) is not passed on."""
    import torch

    try:
        try:
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):  # a file of torch's legacy (pre-zip) format cannot be mapped: read it
                raise
            torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        name = refused_pickle(err)
        if name is not None:
            named = f", {name}," if name else ""
            raise ModelDirError(
                f"{file}: not model weights: it holds a pickled Python object{named} where a weights "
                "file holds only tensors, and was not loaded (unpickling it could run code); use the "
                "model's safetensors weights, or weights from a source you trust") from err
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ModelDirError(
            f"{file}: not a readable PyTorch weights file ({first}); re-download or re-export the "
            "model") from err

"""Quantized checkpoints as released, dequantized on load: the one job of this module.

Two formats are read, both from config.json's `quantization_config`:

- **fp8, block-wise** (`quant_method: fp8`, `weight_block_size: [bo, bi]`; Qwen's `*-FP8`, DeepSeek-V3): each
  quantized weight `W` [..., out, in] is float8 (e4m3fn) with a float32 `W_scale_inv` (`X.weight` ->
  `X.weight_scale_inv`, a fused `X` -> `X_scale_inv`) of one value per bo x bi block, [..., ceil(out / bo),
  ceil(in / bi)]: w = fp8.float() * scale_inv expanded per block, the edge blocks cut where a dim is not a
  multiple of the block (transformers' Fp8Dequantize, integrations/finegrained_fp8.py, takes only whole
  blocks).
- **mxfp4** (`quant_method: mxfp4`; GPT-OSS): an expert weight `X` is stored as `X_blocks` (uint8 [..., rows,
  G, 16], two fp4 e2m1 values a byte, the low nibble first) and `X_scales` (uint8 e8m0 exponents [..., rows,
  G], one per 32 values): w = e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6, sign in bit 3) * 2 ** (e8m0 - 127), laid
  out [..., rows, G * 32] and transposed to [..., G * 32, rows] (GPT-OSS's `gate_up_proj` [E, hidden, 2 *
  inter], gate/up interleaved as stored; transformers' `convert_moe_packed_tensors`, integrations/mxfp4.py).

Any other `quant_method` (or fp8 without a block size) is refused in one line naming it and what is read. The
model is built from its config with the `quantization_config` removed, and the dequantized tensors (every
other tensor of the checkpoint cast alike) go through transformers' own loading (`from_pretrained(None,
config=..., state_dict=...)`: its key renames and expert fusions apply as for a plain checkpoint). The policy,
the torch engine, the export (a plain checkpoint: its config.json has no quantization block) and `flashdapo
plan` (the dequantized sizes) then see a plain model. vLLM builds quantized layers from the directory's
config: on a machine without CUDA its CPU build is refused for a quantized checkpoint
(rollout/engine_models.py). Host memory on the reading rank: the dequantized state dict and the model, two
copies in the trainer's dtype.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .model_dir import ModelDirError

SUPPORTED = "fp8 (block-wise: weight_block_size) and mxfp4"
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32
"""Values per e8m0 scale (16 bytes of two nibbles)."""


class QuantizedCheckpointError(ModelDirError):
    """A quantized checkpoint flashdapo does not read (or whose tensors do not match its format); one line."""


@dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's quantization, as read from its config.json."""

    method: str  # "fp8" or "mxfp4"
    block: tuple[int, int] | None = None  # fp8's weight_block_size

    def describe(self) -> str:
        if self.method == "fp8":
            return f"fp8 (block {self.block[0]}x{self.block[1]})"
        return f"mxfp4 ({MXFP4_GROUP}-value blocks, e8m0 scales)"


def quant_format(config: dict[str, Any], where: str) -> QuantFormat | None:
    """The quantization of a checkpoint whose config.json values are `config` (None: a plain checkpoint); an
    unsupported one raises QuantizedCheckpointError naming `where`, its quant_method and what is read."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "fp8":
        block = qc.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantizedCheckpointError(
                f"{where}: quantization_config quant_method 'fp8' without a block size (weight_block_size "
                f"{block!r}: per-tensor fp8) is not supported; flashdapo dequantizes {SUPPORTED} checkpoints")
        return QuantFormat("fp8", (int(block[0]), int(block[1])))
    if method == "mxfp4":
        return QuantFormat("mxfp4")
    raise QuantizedCheckpointError(
        f"{where}: quantization_config quant_method {method!r} is not supported; "
        f"flashdapo dequantizes {SUPPORTED} checkpoints (or train an unquantized one)")


def dir_format(path: str | Path, where: str = "model.path") -> QuantFormat | None:
    """quant_format of the checkpoint directory `path` (its config.json)."""
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    return quant_format(config, f"{where}={path}")


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """fp8 `weight` [..., rows, cols] times its per-block `scale_inv` [..., ceil(rows / b0), ceil(cols / b1)],
    edge blocks cut to the weight; computed in float32, returned in `dtype`."""
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise QuantizedCheckpointError(
            f"{name}: weight_scale_inv has shape {tuple(scale_inv.shape)}, expected "
            f"{expected} for a {tuple(weight.shape)} weight in {block[0]}x{block[1]} "
            "blocks; the checkpoint does not match its quantization_config")
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                     name: str = "blocks") -> torch.Tensor:
    """MXFP4 `blocks` (uint8 [..., rows, G, 16]) and `scales` (uint8 e8m0 [..., rows, G]) as the weight
    [..., G * 32, rows] (the last two dims transposed, as GPT-OSS holds them); float32 math, `dtype` out."""
    if blocks.dim() < 3 or tuple(blocks.shape[:-1]) != tuple(
            scales.shape) or blocks.shape[-1] * 2 != MXFP4_GROUP:
        raise QuantizedCheckpointError(f"{name}: mxfp4 blocks {tuple(blocks.shape)} and scales "
                                       f"{tuple(scales.shape)} do not pair (expected [..., rows, G, 16] and "
                                       "[..., rows, G])")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    packed = blocks.to(torch.uint8)
    values = torch.stack([lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]], dim=-1)  # low nibble first
    values = values.reshape(*blocks.shape[:-1], MXFP4_GROUP)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.reshape(*blocks.shape[:-2], -1).transpose(-1, -2).contiguous().to(dtype)


def _shard_files(path: Path) -> list[Path]:
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise QuantizedCheckpointError(
            f"model.path={path}: a quantized checkpoint without *.safetensors weights; "
            "flashdapo dequantizes safetensors checkpoints")
    return shards


def dequantized_state_dict(path: str | Path, fmt: QuantFormat,
                           dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], int]:
    """Every tensor of the safetensors checkpoint in `path`, quantized ones dequantized, floating ones in
    `dtype`, under the plain checkpoint's names (scales dropped, `X_blocks` -> `X`); and the bytes the
    checkpoint's tensors take on disk."""
    from safetensors import safe_open

    root = Path(path)
    with ExitStack() as stack:
        files = {}
        for shard in _shard_files(root):
            handle = stack.enter_context(safe_open(str(shard), framework="pt"))
            files.update({key: handle for key in handle.keys()})
        disk = 0
        out: dict[str, torch.Tensor] = {}
        for key, handle in files.items():
            tensor = handle.get_tensor(key)
            disk += tensor.numel() * tensor.element_size()
            plain = _plain(key, tensor, files, fmt, dtype)
            if plain is not None:
                out[plain[0]] = plain[1]
        return out, disk


def _plain(key: str, tensor: torch.Tensor, files: dict[str, Any], fmt: QuantFormat,
           dtype: torch.dtype) -> tuple[str, torch.Tensor] | None:
    """(name, tensor) of the plain checkpoint for one stored tensor; None for a scale (read with its
    weight)."""
    if fmt.method == "fp8":
        if key.endswith(("weight_scale_inv", "_scale_inv", ".input_scale", ".activation_scale")):
            return None
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_key = key[:-len("weight")] + "weight_scale_inv" if key.endswith(
                ".weight") else key + "_scale_inv"
            if scale_key not in files:
                raise QuantizedCheckpointError(
                    f"{key}: an fp8 tensor without its {scale_key}; the checkpoint does not "
                    "match its quantization_config")
            return key, dequantize_fp8(tensor, files[scale_key].get_tensor(scale_key), fmt.block, dtype, key)
    else:
        if key.endswith("_scales"):
            return None
        if key.endswith("_blocks"):
            scale_key = key[: -len("_blocks")] + "_scales"
            if scale_key not in files:
                raise QuantizedCheckpointError(
                    f"{key}: mxfp4 blocks without their {scale_key}; the checkpoint does "
                    "not match its quantization_config")
            return key[:-len("_blocks")], dequantize_mxfp4(tensor, files[scale_key].get_tensor(scale_key),
                                                           dtype, key)
    return key, tensor.to(dtype) if tensor.is_floating_point() else tensor


def plain_config(config) -> Any:
    """A transformers config without its quantization_config (in place; returned): what the model is built
    from and what an export writes."""
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return config


def gib(n: int) -> str:
    """Bytes as GiB, 2 significant figures below 10 (a tiny model's size stays readable)."""
    value = n / 2**30
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


@dataclass(frozen=True)
class Loaded:
    """A dequantized model and its start-up line."""

    model: torch.nn.Module
    line: str


def load_dequantized(path: str | Path, fmt: QuantFormat, dtype: torch.dtype, attention: str,
                     where: str = "model.path", purpose: str = "training") -> Loaded:
    """The model of the quantized checkpoint in `path` built plain and loaded with its dequantized tensors;
    its line says `purpose` (training, sampling)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = plain_config(AutoConfig.from_pretrained(str(path)))
    state, disk = dequantized_state_dict(path, fmt, dtype)
    model, info = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(None, config=config,
                                                                            state_dict=state, dtype=dtype,
                                                                            attn_implementation=attention,
                                                                            output_loading_info=True)
    del state
    # A tensor the model lacks is dropped, as from_pretrained drops it (DeepSeek-V3's multi-token-prediction
    # layer); a parameter without a tensor would train from its random init: refused.
    missing = sorted(set(info.get("missing_keys", ())) - _tied_names(model))
    if missing:
        raise QuantizedCheckpointError(
            f"{where}={path}: the dequantized {fmt.method} checkpoint does not fit its "
            f"model: no tensor for {missing[0]} ({len(missing)} missing)")
    model.config._name_or_path = str(path)  # the export's source (its expert layout)
    size = sum(t.numel() * t.element_size() for t in {id(t): t for t in model.state_dict().values()}.values())
    line = (
        f"{where} {path}: {fmt.describe()} checkpoint, dequantized to {str(dtype).removeprefix('torch.')} "
        "for "
        f"{purpose}: {gib(size)} GiB of weights instead of {gib(disk)} GiB")
    return Loaded(model, line)


def _tied_names(model) -> set[str]:
    """Names the model ties to another tensor (a tied LM head), absent from a checkpoint by design."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    names = set(tied) if isinstance(tied, dict) else set(tied)
    return names if getattr(model.config, "tie_word_embeddings", False) else set()


def load_pretrained(path: str | Path, dtype: torch.dtype, attention: str, log=None,
                    where: str = "model.path", purpose: str = "training") -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained(path)` for a plain checkpoint; a quantized one dequantized into a
    plain model (`load_dequantized`), its line given to `log`."""
    fmt = dir_format(path, where)
    if fmt is None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attention)
    loaded = load_dequantized(path, fmt, dtype, attention, where, purpose)
    if log is not None:
        log(loaded.line)
    return loaded.model


__all__ = ["QuantFormat", "QuantizedCheckpointError", "SUPPORTED", "dequantize_fp8", "dequantize_mxfp4",
           "dequantized_state_dict", "dir_format", "load_dequantized", "load_pretrained", "plain_config",
           "quant_format"]

"""Tiny checkpoints written as quantized releases are, each with its dequantized twin: a tiny Qwen3 in the
fine-grained fp8 format (float8_e4m3fn weights, a float32 weight_scale_inv per 16 x 16 block, intermediate size
72 so that edge blocks are cut) and a tiny GPT-OSS in MXFP4 (experts as uint8 `_blocks` of two e2m1 nibbles and
e8m0 `_scales`, one per 32 values). The twin is a plain directory of the same model holding the dequantized
values, computed here block by block (not by flashdapo.models.quantized)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from flashdapo.config import ToyTaskConfig
from flashdapo.tasks.toy import build_toy_tokenizer
from tests.helpers.family_configs import family_config

FP8_BLOCK = 16
FP8_MAX = 448.0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_fp8(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, weight_scale_inv per block, the dequantized weight) of a 2-D `w`, block by block."""
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    deq = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            part = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s = part.abs().max().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            q_part = (part / s).to(torch.float8_e4m3fn)
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = q_part
            deq[i * block:(i + 1) * block, j * block:(j + 1) * block] = q_part.float() * s
    return q, scale, deq


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks uint8 [E, rows, G, 16], scales uint8 [E, rows, G], the dequantized weight) of a GPT-OSS expert
    weight `w` [E, cols, rows] (stored transposed: rows = its last dim), 32 values per scale."""
    stored = w.transpose(1, 2).float()  # [E, rows, cols]
    e, rows, cols = stored.shape
    groups = stored.reshape(e, rows, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    table = torch.tensor(E2M1)
    code = (scaled.abs().unsqueeze(-1) - table).abs().argmin(-1)  # nearest magnitude
    code = code + 8 * (scaled < 0).long()
    nibbles = code.to(torch.uint8).reshape(e, rows, cols // 32, 16, 2)
    blocks = nibbles[..., 0] | (nibbles[..., 1] << 4)
    signed = torch.tensor(E2M1 + tuple(-v for v in E2M1))
    deq = signed[code] * torch.exp2(exponent).unsqueeze(-1)
    return blocks, (exponent + 127).to(torch.uint8), deq.reshape(e, rows, cols).transpose(1, 2).contiguous()


def _write(model, quantized: dict[str, torch.Tensor], drop: set[str], qconfig: dict, path: Path, twin: Path) -> None:
    """The twin saved plainly; `path`: its files with `drop` tensors replaced by `quantized` ones and
    `qconfig` in config.json."""
    tok = build_toy_tokenizer(ToyTaskConfig())
    model.save_pretrained(twin)
    tok.save_pretrained(twin)
    shutil.copytree(twin, path)
    tensors = load_file(str(path / "model.safetensors"))
    missing = drop - set(tensors)
    assert not missing, f"names not in the saved checkpoint: {sorted(missing)}"
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    save_file({**tensors, **quantized}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qconfig
    (path / "config.json").write_text(json.dumps(config, indent=2))


@torch.no_grad()
def fp8_qwen3_dir(path: Path, twin: Path, seed: int = 0, head_dim: int = 16) -> tuple[Path, Path]:
    """A tiny Qwen3 (hidden 64, intermediate 72, 2 layers) in the fp8 16 x 16 block format, and its twin
    (`head_dim` 32: a size vLLM's CPU attention takes)."""
    torch.manual_seed(seed)
    config = family_config("qwen3", hidden_size=64, intermediate_size=72, head_dim=head_dim)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    quantized, drop = {}, set()
    for name, param in model.named_parameters():
        if name.endswith(".weight") and name.split(".")[-2] in FP8_QUANTIZED:
            q, scale, deq = quantize_fp8(param)
            param.copy_(deq)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            drop.add(name)
    qconfig = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
               "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    _write(model, quantized, drop, qconfig, path, twin)
    return path, twin


@torch.no_grad()
def mxfp4_gpt_oss_dir(path: Path, twin: Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny GPT-OSS (hidden 32, 4 experts of 32) with its experts in MXFP4, and its twin."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config("gpt_oss"), dtype=torch.float32)
    quantized, drop = {}, set()
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, deq = quantize_mxfp4(param)
            param.copy_(deq)
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            drop.add(name)
    qconfig = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                          "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
    _write(model, quantized, drop, qconfig, path, twin)
    return path, twin


__all__ = ["fp8_qwen3_dir", "mxfp4_gpt_oss_dir", "quantize_fp8", "quantize_mxfp4"]

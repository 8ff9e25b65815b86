"""The model a plan is for, as its config.json: the checkpoint's own, a file given, a built-in shape, or the
toy model's config.

Built-in shapes are the Hugging Face config.json values of the Qwen2.5 base models (hub repositories
Qwen/Qwen2.5-0.5B ... Qwen/Qwen2.5-32B, files config.json) and of the mixture-of-experts Qwen3-30B-A3B
(Qwen/Qwen3-30B-A3B): what a preset's `model.path` names (checkpoints/Qwen2.5-32B) when the checkpoint is
not on the planning machine. Only the fields that shape the parameters, the attention, the experts and the
positions are kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError


def _qwen25(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool,
            positions: int) -> dict[str, Any]:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "tie_word_embeddings": tied,
            "max_position_embeddings": positions, "hidden_act": "silu", "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-06, "use_sliding_window": False}


def _qwen3_moe(hidden: int, intermediate: int, moe_intermediate: int, layers: int, heads: int, kv_heads: int,
               head_dim: int, experts: int, top_k: int, vocab: int, tied: bool,
               positions: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
        "intermediate_size": intermediate, "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_experts": experts, "num_experts_per_tok": top_k, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "vocab_size": vocab,
        "tie_word_embeddings": tied, "max_position_embeddings": positions, "hidden_act": "silu",
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "attention_bias": False, "use_sliding_window": False
    }


BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": _qwen25(896, 4864, 24, 14, 2, 151936, True, 32768),
    "Qwen2.5-1.5B": _qwen25(1536, 8960, 28, 12, 2, 151936, True, 131072),
    "Qwen2.5-3B": _qwen25(2048, 11008, 36, 16, 2, 151936, True, 32768),
    "Qwen2.5-7B": _qwen25(3584, 18944, 28, 28, 4, 152064, False, 131072),
    "Qwen2.5-14B": _qwen25(5120, 13824, 48, 40, 8, 152064, False, 131072),
    "Qwen2.5-32B": _qwen25(5120, 27648, 64, 40, 8, 152064, False, 131072),
    # 30.5B parameters, 3.3B active per token: 128 experts of width 768 in each of 48 layers, top 8.
    "Qwen3-30B-A3B": _qwen3_moe(2048, 6144, 768, 48, 32, 4, 128, 128, 8, 151936, False, 40960),
}
"""Built-in config.json values (huggingface.co/Qwen/<name>/blob/main/config.json)."""


@dataclass
class ModelSource:
    """The config.json a plan uses and where it came from."""

    config: dict[str, Any]
    origin: str
    """'checkpoints/Qwen2.5-32B/config.json', 'built-in shape Qwen2.5-32B (...)', 'the toy model'."""
    model_dir: str | None = None
    """A checkpoint directory on this machine (its tokenizer can be checked), else None."""
    toy: bool = False
    notes: list[str] = field(default_factory=list)


def builtin_shape(name: str) -> dict[str, Any] | None:
    """The built-in config.json of `name` (case-insensitive, e.g. 'qwen2.5-32b'), or None."""
    for key, values in BUILTIN_SHAPES.items():
        if key.lower() == name.lower():
            return dict(values)
    return None


def model_source(cfg: Config, model_config: str | None = None, model_shape: str | None = None) -> ModelSource:
    """The model of `cfg`: `model_config` (a config.json path) first, then `model_shape` (a built-in name),
    then model.path's config.json when it is here, then the built-in shape named by model.path's last
    component; an empty model.path is the toy model. A config.json read from a file is checked as the launch
    checks it (preflight.check_model_shape) before anything builds it: one line naming the file and field."""
    if model_config:
        path = Path(model_config).expanduser()
        if not path.is_file():
            raise ConfigError(f"--model-config: {model_config} is not a file; give a model's config.json")
        return ModelSource(read_config_json(path, "--model-config"), str(path))
    if model_shape:
        values = builtin_shape(model_shape)
        if values is None:
            raise ConfigError(
                f"--model-shape: unknown shape {model_shape!r}; known: {', '.join(BUILTIN_SHAPES)}")
        return ModelSource(values, _builtin_origin(model_shape))
    if not cfg.model.path:
        return ModelSource({}, "the toy model (model.toy)", toy=True)
    here = Path(cfg.model.path) / "config.json"
    if here.is_file():
        return ModelSource(read_config_json(here, "model.path"), str(here), model_dir=cfg.model.path)
    values = builtin_shape(Path(cfg.model.path).name)
    if values is None:
        raise ConfigError(
            f"model.path: {cfg.model.path} has no config.json on this machine and its name is not a "
            f"built-in shape ({', '.join(BUILTIN_SHAPES)}); give --model-config FILE (its config.json) "
            "or --model-shape NAME")
    return ModelSource(values, _builtin_origin(Path(cfg.model.path).name))


def read_config_json(path: Path, field: str) -> dict[str, Any]:
    """The model config.json at `path` (given by `field`), checked: valid JSON, an object, and what the launch
    checks of it (preflight.check_model_shape: architecture, positive integer sizes, heads that divide)."""
    from ..preflight import check_model_shape

    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"{field}: {path}: cannot read it ({err.strerror})") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"{field}: {path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                          f"{err.start})") from err
    except json.JSONDecodeError as err:
        raise ConfigError(f"{field}: {path}: not valid JSON at line {err.lineno}, column {err.colno}: "
                          f"{err.msg}") from err
    check_model_shape(values, f"{field}={path}", str(path))
    return values


def _builtin_origin(name: str) -> str:
    key = next(k for k in BUILTIN_SHAPES if k.lower() == name.lower())
    return f"built-in shape {key} (huggingface.co/Qwen/{key} config.json)"


__all__ = ["BUILTIN_SHAPES", "ModelSource", "builtin_shape", "model_source", "read_config_json"]

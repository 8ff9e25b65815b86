"""Tiny random HF model directories of each supported architecture (and GPT-2, which is not), with the toy
task's tokenizer: the four first families at hidden 16, every other family of the matrix at its tiny size
(tests/helpers/family_configs.py)."""

from pathlib import Path

from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from flashdapo.config import ToyTaskConfig
from flashdapo.tasks.toy import build_toy_tokenizer
from tests.helpers.family_configs import family_config

SHAPE = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
CONFIGS = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "mistral": MistralConfig}


def model_dir(path: Path, model_type: str = "qwen2", positions: int = 64, chat_template: bool = True,
              tokenizer_edit=None, **config) -> Path:
    """A tiny random model of `model_type` with the toy tokenizer, saved as an HF directory."""
    tok = build_toy_tokenizer(ToyTaskConfig())
    if not chat_template:
        tok.chat_template = None
    if model_type == "gpt2":
        hf_config = GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=positions)
    elif model_type not in CONFIGS:  # another family of the matrix: a sliding and a full-attention layer
        hf_config = family_config(model_type, max_position_embeddings=positions,
                                  vocab_size=config.pop("vocab_size", len(tok)), **config)
    else:
        extra = {"head_dim": 8} if model_type == "qwen3" else {}
        hf_config = CONFIGS[model_type](vocab_size=config.pop("vocab_size", len(tok)), max_position_embeddings=positions,
                                        tie_word_embeddings=True, **SHAPE, **extra, **config)
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(path)
    tok.save_pretrained(path)
    if tokenizer_edit is not None:
        tokenizer_edit(path)
    return path

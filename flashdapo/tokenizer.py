"""Tokenizers: a tiny byte-level BPE trained locally for the toy task, or a local HF tokenizer directory.

Choices, stated first:
- The toy tokenizer mirrors Qwen2's: byte-level BPE (every byte is a token, so any text encodes and
  decoding round-trips exactly), Qwen2's pre-tokenizer regex with digits split one per token, special
  tokens `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos), a ChatML chat template. Unlike
  Qwen2's template it adds no default system message: the toy model's context is small.
- It is trained at run time (well under a second) on text made from the toy task's prompts and
  responses, deterministically; nothing is downloaded.
- `load_tokenizer` reads a local directory only (`local_files_only`), never the hub.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .config import ToyTaskConfig

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
TOY_VOCAB_SIZE = 512
"""Upper bound of the toy vocabulary (256 bytes + 3 special tokens + learned merges)."""

# Qwen2's pre-tokenization regex: contractions, letter runs, single digits, punctuation runs, spaces.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2-style ChatML without the default system message."""


def _toy_corpus(cfg: ToyTaskConfig) -> list[str]:
    """The text the toy tokenizer learns from: the role lines, prompts and responses of the toy task."""
    from .data import toy_records  # data imports this module's users, not the reverse; keep it lazy

    lines = []
    for split in ("train", "val"):
        for record in toy_records(cfg, split)[:1000]:
            lines.append("user\n" + record.messages[0]["content"])
            lines.append("assistant\nAnswer: " + record.ground_truth)
    return lines


def build_toy_tokenizer(cfg: ToyTaskConfig, vocab_size: int = TOY_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE (Qwen2-style, digits split) on the toy task's text; deterministic."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_toy_corpus(cfg), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    hf.add_special_tokens({"additional_special_tokens": [IM_START]})
    hf.chat_template = CHATML_TEMPLATE
    return _ensure_pad(hf)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local HF checkpoint directory (never the hub); pad_token is always set."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer: {path!r} is not a directory (model.path must be a local HF "
                                "checkpoint directory; nothing is downloaded)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"tokenizer: cannot load a tokenizer from {path!r}: {err}") from err
    return _ensure_pad(tokenizer)


def _ensure_pad(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Set pad_token when missing: `<|endoftext|>` if the vocabulary has it, else the eos token."""
    if tokenizer.pad_token is None:
        if PAD_TOKEN in tokenizer.get_vocab():
            tokenizer.pad_token = PAD_TOKEN
        elif tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            raise ValueError("tokenizer: it has neither a pad token, nor <|endoftext|>, nor an eos token")
    return tokenizer


def eos_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids that end a response: the eos token, plus `<|endoftext|>` and `<|im_end|>` when present."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for token in (PAD_TOKEN, IM_END):
        if token in vocab and int(vocab[token]) not in ids:
            ids.append(int(vocab[token]))
    return ids

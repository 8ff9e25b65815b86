"""Tokenizers: loading a local HF tokenizer directory, and the special tokens flashdapo relies on.

- `load_tokenizer` reads a local directory only (`local_files_only`), never the hub, and always sets a
  pad token. The toy task's own tokenizer is trained in toy.py.
- A response ends at the eos token, or at `<|endoftext|>` / `<|im_end|>` when the vocabulary has them.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

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
    return ensure_pad(tokenizer)


def ensure_pad(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
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

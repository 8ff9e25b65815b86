"""Tokenizers: loading a local HF tokenizer directory, and the special tokens flashdapo relies on.

- `load_tokenizer` reads a local directory only (`local_files_only`), never the hub, and always sets a
  pad token. The toy task's own tokenizer is trained in toy.py.
- A response ends at any of the stop tokens (`eos_token_ids`): the tokenizer's eos, `<|endoftext|>` /
  `<|im_end|>` when the vocabulary has them, the model directory's generation_config.json `eos_token_id`
  (an int or a list; Llama-3 lists `<|end_of_text|>` and `<|eot_id|>`), and the chat template's end-of-turn
  token. Both rollout engines, training, eval and generate stop on this one set.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
# End-of-turn tokens of known chat formats (Llama-3, ChatML, Gemma, Phi-3): a stop token when the vocabulary
# has it and the chat template emits it.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>")
_MARKER = "FLASHDAPO_STOP_MARKER"

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


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | Path | None = None) -> list[int]:
    """The token ids that end a response (the one stop set of both engines, training, eval and generate), in
    this order, without repeats: the tokenizer's eos; `<|endoftext|>` and `<|im_end|>` when present; the
    `eos_token_id` (int or list) of `model_dir`/generation_config.json (default: the directory the tokenizer
    was loaded from), where the id is one of the tokenizer's special/added tokens; the chat template's
    end-of-turn token (`chat_end_of_turn_ids`)."""
    ids: list[int] = []

    def add(token_id: int | None) -> None:
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))

    add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    for token in (PAD_TOKEN, IM_END):
        if token in vocab:
            add(vocab[token])
    specials = _special_ids(tokenizer)
    for token_id in generation_config_eos_ids(model_dir if model_dir is not None else loaded_from(tokenizer)):
        # a model config's default eos (e.g. LlamaConfig's 2) may be an ordinary token
        if token_id in specials:
            add(token_id)
    for token_id in chat_end_of_turn_ids(tokenizer):
        add(token_id)
    return ids


def generation_config_eos_ids(model_dir: str | Path | None) -> list[int]:
    """`eos_token_id` of `model_dir`/generation_config.json as a list ([] when the file or the key is
    absent)."""
    if model_dir is None:
        return []
    path = Path(model_dir) / "generation_config.json"
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def chat_end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special token the chat template emits right after a turn's content (rendered from a two-message
    conversation), and the known end-of-turn tokens (`END_OF_TURN_TOKENS`) the vocabulary has and the template
    names. [] without a chat template."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return []
    ids: list[int] = []
    specials = _special_ids(tokenizer)
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": _MARKER}], tokenize=False)
    except Exception:  # noqa: BLE001  (a template may refuse this conversation: the known tokens still count)
        text = ""
    if isinstance(text, str) and _MARKER in text:
        after = text[text.index(_MARKER) + len(_MARKER):]
        for token_id in tokenizer(after, add_special_tokens=False)["input_ids"][:8]:
            if int(token_id) in specials:
                ids.append(int(token_id))
                break
            if tokenizer.decode([token_id]).strip():
                break  # ordinary text follows the content: no end-of-turn token here
    vocab = tokenizer.get_vocab()
    templates = template if isinstance(template, str) else " ".join(str(t) for t in dict(template).values())
    for token in END_OF_TURN_TOKENS:
        if token in vocab and token in templates and int(vocab[token]) not in ids:
            ids.append(int(vocab[token]))
    return ids


def describe_stop_ids(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """`ids` with their tokens, for the start-up line and warnings: `128001 '<|end_of_text|>', 128009
    '<|eot_id|>'`."""
    return ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in ids) or "none"


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids of the tokenizer's special and added tokens."""
    found = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    found.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
    return found


def loaded_from(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The local directory the tokenizer was loaded from, if any (None for one built in memory, the toy
    task's)."""
    name = getattr(tokenizer, "name_or_path", None)
    return name if name and Path(name).is_dir() else None

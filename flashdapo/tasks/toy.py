"""The built-in toy task, everything the default preset needs without a download: small-integer
arithmetic posed as a math problem, a tokenizer trained on it, a tiny Qwen2-style model, and the
demonstrations of the supervised warm-up (tasks/warmup.py) that makes it the "base model" DAPO starts from.

Choices, stated first:
- A problem is "Compute 7+12. End with Answer: N" (the format is `data.toy.prompt_format`); its ground
  truth is the integer as a string, checked by the DAPO "Answer:" verifier. Problems are deterministic
  in `data.toy.seed`; validation takes distinct problems, held out of training or not (`held_out_val`).
- The tokenizer mirrors Qwen2's: byte-level BPE (every byte is a token, so any text encodes and decoding
  round-trips exactly), Qwen2's pre-tokenizer regex with digits split one per token, special tokens
  `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos), a ChatML chat template without the default
  system message (the toy model's context is small). It is trained at run time (well under a second) on
  the task's prompts and responses, deterministically.
- The warm-up is deliberately brief and partly wrong (`wrong_fraction`, `verbose_fraction`): DAPO then
  starts from a policy that knows the answer format but is often wrong, which is what RL sharpens.
- The long-tail variant (`filler_median` > 0, the `longtail` preset) opens each demonstration with a
  lognormal number of filler tokens: the warmed-up model's response lengths are heavy-tailed (a few very
  long responses per batch), the workload on which a round waits for its longest response.
Real runs load an HF checkpoint (`model.path`) and data files instead, and use none of this.
"""

from __future__ import annotations

import math
import random
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from ..config import ConfigError, ModelConfig, ToyTaskConfig, field_path
from ..data import Record
from ..models.hf import resolved_attention
from ..tokenizer import IM_END, IM_START, PAD_TOKEN, SPECIAL_TOKENS, ensure_pad

TOY_DATA_SOURCE = "toy_arithmetic"
TOY_VOCAB_SIZE = 512
"""Upper bound of the toy vocabulary (256 bytes + 3 special tokens + learned merges)."""


# ---------------------------------------------------------------------------------------------------
# Problems and records


Problem = tuple[int, str, int]


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def toy_problems(cfg: ToyTaskConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, val) problems. held_out_val: val takes distinct problems and train cycles through all the
    others; otherwise train cycles through every problem and val is a distinct sample of them."""
    every = [(a, op, b) for op in cfg.ops for a in range(cfg.max_operand + 1)
             for b in range(cfg.max_operand + 1) if op != "-" or a >= b]
    limit = len(every) - 1 if cfg.held_out_val else len(every)
    if cfg.num_val > limit:
        raise ConfigError(
            f"{field_path(ToyTaskConfig, 'num_val')}: expected at most {limit} for the {len(every)} "
            f"distinct problems of "
            f"max_operand={cfg.max_operand}, ops={cfg.ops!r} (held_out_val={cfg.held_out_val}), "
            f"got {cfg.num_val}")
    random.Random(cfg.seed).shuffle(every)
    val = every[:cfg.num_val]
    pool = every[cfg.num_val:] if cfg.held_out_val else every
    return [pool[i % len(pool)] for i in range(cfg.num_train)], val


def _toy_record(problem: Problem, cfg: ToyTaskConfig, source: str) -> Record:
    a, op, b = problem
    content = cfg.prompt_format.format(expr=f"{a}{op}{b}", a=a, op=op, b=b)
    return Record([{"role": "user", "content": content}], str(_answer(a, op, b)), source, TOY_DATA_SOURCE)


def toy_records(cfg: ToyTaskConfig, split: Literal["train", "val"]) -> list[Record]:
    """The toy task's records: train and val are disjoint, both deterministic in cfg.seed."""
    if split not in ("train", "val"):
        raise ValueError(f"toy_records: split must be 'train' or 'val', got {split!r}")
    train, val = toy_problems(cfg)
    problems = train if split == "train" else val
    return [_toy_record(p, cfg, f"toy:{split}:{i}") for i, p in enumerate(problems)]


def toy_sft_examples(cfg: ToyTaskConfig, n: int, rng: random.Random) -> list[tuple[Record, str]]:
    """`n` (prompt record, response) pairs drawn from the train split: 'Answer: 19', or with probability
    cfg.verbose_fraction the verbose '7+12=19' newline 'Answer: 19'; with probability cfg.wrong_fraction
    the answer is a near miss. With cfg.filler_median > 0 a line of filler tokens opens each response
    (`filler_count` of them; the long-tail variant)."""
    train, _ = toy_problems(cfg)
    picks = [train[rng.randrange(len(train))] for _ in range(n)]
    out = []
    for i, problem in enumerate(picks):
        record = _toy_record(problem, cfg, f"toy:sft:{i}")
        value = int(record.ground_truth)
        if rng.random() < cfg.wrong_fraction:
            value = abs(value + rng.choice((-2, -1, 1, 2)))  # a near miss, never negative
            value = value if value != int(record.ground_truth) else value + 1
        answer = f"Answer: {value}"
        if rng.random() < cfg.verbose_fraction:
            a, op, b = problem
            answer = f"{a}{op}{b}={value}\n{answer}"
        if cfg.filler_median > 0:  # drawn only then: the default examples stay those of the plain toy
            count = filler_count(cfg, rng)
            answer = f"{FILLER * count}\n{answer}" if count else answer
        out.append((record, answer))
    return out


FILLER = "."
"""The filler token of the long-tail variant: one token each in the toy tokenizer (never merged: no run of
them is in the tokenizer's corpus)."""
FILLER_CAP = 20
"""Filler counts are capped at FILLER_CAP x data.toy.filler_median."""


def filler_count(cfg: ToyTaskConfig, rng: random.Random) -> int:
    """Filler tokens opening one warm-up response: lognormal with median cfg.filler_median and log-sd
    cfg.filler_sigma, rounded, capped at FILLER_CAP x the median."""
    draw = rng.lognormvariate(math.log(cfg.filler_median), cfg.filler_sigma)
    return min(round(draw), int(FILLER_CAP * cfg.filler_median))


# ---------------------------------------------------------------------------------------------------
# Tokenizer


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
    lines = []
    for split in ("train", "val"):
        for record in toy_records(cfg, split)[:1000]:
            lines.append("user\n" + record.messages[0]["content"])
            lines.append("assistant\nAnswer: " + record.ground_truth)
    return lines


def build_toy_tokenizer(cfg: ToyTaskConfig, vocab_size: int = TOY_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE (Qwen2-style, digits split) on the toy task's text; deterministic."""
    return train_chat_tokenizer(_toy_corpus(cfg), vocab_size)


def train_chat_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (Qwen2-style, digits split, ChatML template) trained on `corpus`; deterministic.
    Shared by the built-in tasks."""
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
    tok.train_from_iterator(corpus, trainer=trainer)
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
    return ensure_pad(hf)


# ---------------------------------------------------------------------------------------------------
# Model


def build_toy_model(cfg: ModelConfig, vocab_size: int, max_positions: int, seed: int) -> Qwen2ForCausalLM:
    """A tiny Qwen2 from a config (no download), initialized from `seed`, fp32."""
    toy = cfg.toy
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=toy.hidden_size,
        intermediate_size=toy.intermediate_size,
        num_hidden_layers=toy.num_layers,
        num_attention_heads=toy.num_heads,
        num_key_value_heads=toy.num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        attn_implementation=resolved_attention(cfg.attn_implementation, None),
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)

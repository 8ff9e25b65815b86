"""Config sections of what is trained and on what: the policy model (`model`, its built-in toy shape
`model.toy`) and the prompt data (`data`, with the built-in tasks `data.toy` and `data.scratchpad`).
The root of the tree is tree.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from .checks import (
    IS_PATH,
    SEED_MAX,
    TOKENS_MAX,
    TOKENS_WHY,
    Check,
    Fraction,
    NonNegative,
    PathStr,
    Positive,
    PositiveFloat,
    Rule,
    Section,
    at_most,
    ge,
    within,
)

TOY_MODEL = "the built-in toy model, built on this machine; a real model comes from model.path"
GENERATED = "generated up front, in memory"
SFT_EXAMPLES_MAX = 10_000_000
"""model.toy.sft_steps x sft_batch: the warm-up's examples are generated up front, in memory."""


def _formats_toy_prompt(text: str) -> bool:
    try:
        text.format(expr="1+2", a=1, op="+", b=2)
    except (KeyError, IndexError, ValueError):
        return False
    return "{expr}" in text or ("{a}" in text and "{b}" in text)


@dataclass
class ToyModelConfig(Section):
    """Shape of the tiny Qwen2-style model built from a config when `model.path` is empty (for either
    built-in task, `data.task`), and its supervised warm-up."""

    hidden_size: Annotated[Positive, at_most(8192, TOY_MODEL)] = 64
    """Model width."""
    num_layers: Annotated[Positive, at_most(256, TOY_MODEL)] = 2
    """Decoder blocks."""
    num_heads: Annotated[Positive, at_most(256, TOY_MODEL)] = 4
    """Attention heads."""
    num_kv_heads: Annotated[Positive, at_most(256, TOY_MODEL)] = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: Annotated[Positive, at_most(32768, TOY_MODEL)] = 192
    """MLP width."""
    sft_steps: Annotated[NonNegative, at_most(1_000_000, f"its examples are {GENERATED}")] = 300
    """Supervised warm-up steps on the built-in task that make the 'base model' before DAPO (0 disables)."""
    sft_lr: PositiveFloat = 3e-3
    """Learning rate of the supervised warm-up."""
    sft_batch: Annotated[Positive, at_most(65536, f"its examples are {GENERATED}")] = 32
    """Examples per supervised warm-up step."""

    RULES = (
        Rule("hidden_size", lambda c: c.hidden_size % c.num_heads == 0, lambda c: "a multiple of num_heads"),
        Rule("num_kv_heads", lambda c: c.num_heads % c.num_kv_heads == 0, lambda c: "a divisor of num_heads"),
        Rule(
            "sft_steps", lambda c: c.sft_steps * c.sft_batch <= SFT_EXAMPLES_MAX, lambda c:
            f"at most {SFT_EXAMPLES_MAX:,} examples in all, sft_steps x sft_batch ({c.sft_batch}) (the "
            f"warm-up's examples are {GENERATED})"),
    )


@dataclass
class ModelConfig(Section):
    """The policy."""

    path: PathStr = ""
    """Local HF checkpoint directory (config, safetensors, tokenizer). Empty: build the toy model."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype used for compute (master weights and gradient reduction stay fp32; FSDP2 mixed
    precision). auto: bfloat16 on CUDA, float32 on CPU (bf16 matmuls on a CPU are several times slower).
    The HF export is written in this dtype, and its config.json says so."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """transformers attention backend of the policy. auto: sdpa, or eager for a family whose attention SDPA
    cannot run right (GPT-OSS's sinks, Gemma 2's attention-logit cap; start-up says so in one line)."""
    gradient_checkpointing: bool = False
    """Recompute decoder-block activations in backward (activation checkpointing)."""
    router_aux_loss_coef: Annotated[float | None, ge(0)] = None
    """Mixture-of-experts models: the weight of the routers' load-balancing loss in the update's loss (per
    sequence, averaged over the mini-batch's sequences: docs/config.md). None: the model config's
    `router_aux_loss_coef` where its `output_router_logits` is true, else off; 0: off."""
    toy: ToyModelConfig = field(default_factory=ToyModelConfig)
    """The built-in toy model (used when `path` is empty)."""


@dataclass
class ToyTaskConfig(Section):
    """The built-in verifiable task: small-integer arithmetic posed as a math problem."""

    num_train: Annotated[Positive, at_most(10_000_000, GENERATED)] = 2000
    """Training problems generated."""
    num_val: Annotated[NonNegative, at_most(1_000_000, GENERATED)] = 100
    """Validation problems (each distinct)."""
    held_out_val: bool = False
    """Validation problems never appear in training (tests generalization). False: validation samples
    the task's own problem set, i.e. measures how many of the task's facts the policy gets right."""
    verbose_fraction: Fraction = 0.3
    """Fraction of warm-up responses that first restate the sum ('7+5=12' then 'Answer: 12'): with a
    short max response length they run into the limit, which gives overlong shaping something to do."""
    wrong_fraction: Fraction = 0.6
    """Fraction of warm-up responses whose answer is a near miss (off by 1 or 2): the warmed-up model
    then knows the candidates but samples the right one only about 1 - wrong_fraction of the time,
    which is what RL sharpens."""
    filler_median: Annotated[float,
                             ge(0),
                             at_most(1000, "each warm-up response opens with up to 20 x this many "
                                     "tokens")] = 0.0
    """Median number of filler tokens ('.' each, then a newline) that open a warm-up response, drawn lognormal
    (filler_sigma) and capped at 20 x the median: the warmed-up model's response lengths are then heavy-tailed
    (the `longtail` preset, bench/bench_longtail.py). 0: no filler."""
    filler_sigma: Annotated[float, ge(0), at_most(10, "a log-normal draw of e^(sigma z) overflows")] = 1.0
    """Standard deviation of the filler count's logarithm (with filler_median > 0): at 1.0 the longest of a
    few hundred responses has ~15-20x the median's filler."""
    max_operand: Annotated[Positive,
                           at_most(999, "every problem, (max_operand + 1)^2 per operation, is listed "
                                   "up front")] = 9
    """Operands are drawn from 0..max_operand."""
    seed: Annotated[NonNegative, SEED_MAX] = 1234
    """Seed of the problem generator."""
    ops: Annotated[str, Check(lambda s: bool(s) and set(s) <= set("+-*") and len(set(s)) == len(s),
                              "distinct characters among '+', '-', '*'")] = "+"
    """Operations drawn from, any of '+', '-', '*' (e.g. "+-"); '-' problems never have a negative answer."""
    prompt_format: Annotated[str, Check(_formats_toy_prompt, "a format string using {expr} (or {a} and {b}) "
                                                             "and no other fields")] = \
        "Compute {expr}. End with Answer: N"
    """The user message; {expr} becomes e.g. '7+12' ({a}, {op}, {b} are also available)."""


def _formats_scratchpad_prompt(text: str) -> bool:
    try:
        text.format(a=1, b=2)
    except (KeyError, IndexError, ValueError):
        return False
    return "{a}" in text and "{b}" in text


@dataclass
class ScratchpadTaskConfig(Section):
    """The built-in scratchpad task (flashdapo/tasks/scratchpad.py): multi-digit addition worked out column by
    column before the answer; harder than the toy, with varying response lengths and a held-out validation
    set."""

    num_train: Annotated[Positive, at_most(10_000_000, GENERATED)] = 2000
    """Training problems generated (distinct, none of them a validation problem)."""
    num_val: Annotated[NonNegative, at_most(1_000_000, GENERATED)] = 64
    """Held-out validation problems (distinct, never in training)."""
    min_digits: Positive = 1
    """Fewest digits of an operand."""
    max_digits: Annotated[int, within(1, 9)] = 2
    """Most digits of an operand; a problem draws its digit count uniformly from min_digits..max_digits, so
    the worked answer (one line per column) grows with it."""
    slip_fraction: Fraction = 0.2
    """Warm-up demonstrations: chance that a column's written sum is off by one (the answer then follows the
    written work): long problems are right less often than short ones."""
    verbose_slip_fraction: Annotated[float | None, within(0, 1)] = None
    """The same chance for long-hand demonstrations (None: slip_fraction). Below slip_fraction, longer work is
    more often right (the token-level loss panel of `flashdapo ablate`)."""
    verbose_fraction: Fraction = 0.35
    """Warm-up demonstrations written long-hand (the problem restated, each column's digit and carry spelled
    out): on long problems these run past the response limit."""
    seed: Annotated[NonNegative, SEED_MAX] = 4321
    """Seed of the problem generator."""
    prompt_format: Annotated[str, Check(_formats_scratchpad_prompt, "a format string using {a} and {b} and "
                                                                    "no "
                                                                    "other fields")] = \
        "Add {a}+{b}. Work column by column, then end with Answer: N"
    """The user message; {a} and {b} are the operands."""

    RULES = (Rule("max_digits", lambda c: c.max_digits >= c.min_digits,
                  lambda c: f">= min_digits ({c.min_digits})"), )


DataFiles = Annotated[list[str], IS_PATH,
                      Check(lambda files: all(f.endswith((".parquet", ".jsonl"))
                                              for f in files), "*.parquet or *.jsonl paths")]


@dataclass
class DataConfig(Section):
    """Prompt datasets: parquet/jsonl in the DAPO-Math-17k schema, or plain {problem, answer} jsonl."""

    train_files: DataFiles = field(default_factory=list)
    """Training files (.parquet or .jsonl). Empty: the built-in toy task."""
    val_files: DataFiles = field(default_factory=list)
    """Validation files (same formats). Empty with empty train_files: the toy task's validation split."""
    max_prompt_length: Annotated[Positive, at_most(TOKENS_MAX, TOKENS_WHY)] = 2048
    """Prompt token budget after the chat template."""
    truncation: Literal["left", "drop", "error"] = "left"
    """Prompts over max_prompt_length: keep the last tokens (DAPO), drop them (counted), or stop."""
    dedup: bool = False
    """Remove exact-duplicate prompts (the public DAPO-Math-17k file holds each problem ~100 times)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (deterministic for `trainer.seed`)."""
    toy: ToyTaskConfig = field(default_factory=ToyTaskConfig)
    """The built-in toy task (used when train_files is empty and task is 'toy')."""
    task: Literal["toy", "scratchpad"] = "toy"
    """The built-in task trained on when train_files is empty: toy (single-digit sums) or scratchpad
    (multi-digit addition with written work, the `flashdapo ablate` task; docs/ablation.md)."""
    scratchpad: ScratchpadTaskConfig = field(default_factory=ScratchpadTaskConfig)
    """The built-in scratchpad task (used when train_files is empty and task is 'scratchpad')."""

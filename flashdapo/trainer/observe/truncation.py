"""The one-line warning when every response a training step generated was truncated: none reached a stop
token.

A chat model whose end-of-turn token is not in the stop set (tokenizer.eos_token_ids) never stops, every
response runs to rollout.max_response_length, and training silently learns nothing; the warning names the stop
ids in force and the length, once per run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...tokenizer import describe_stop_ids, eos_token_ids


def all_truncated(metrics: Mapping[str, float]) -> bool:
    """Whether every response of the step was truncated: `train/gen_truncated` (all generated responses) when
    the step generated, else `response_length/clip_ratio` (the trained ones); False when neither is there."""
    for key in ("train/gen_truncated", "response_length/clip_ratio"):
        if key in metrics:
            return float(metrics[key]) >= 1.0
    return False


def all_truncated_message(step: int, stop_line: str, max_response_length: int) -> str:
    """The warning's text: the step, the stop ids in force and the max response length."""
    return (
        f"warning: step {step}: every response was truncated at rollout.max_response_length="
        f"{max_response_length} tokens; none ended at a stop token (in force: {stop_line}). A chat model "
        "whose "
        "end-of-turn token is not among them never stops: check eos_token_id in the model's "
        "generation_config.json and the tokenizer's eos_token; else raise rollout.max_response_length "
        "(warned once)")


class TruncationWatch:
    """Warns once per run, the first step whose responses were all truncated."""

    def __init__(self, tokenizer: Any, model_dir: str | None, max_response_length: int) -> None:
        self.tokenizer, self.model_dir, self.max_response_length = tokenizer, model_dir, max_response_length
        self.warned = False

    def check(self, step: int, metrics: Mapping[str, float]) -> str | None:
        """The warning for `step` (its metrics reduced over ranks), or None: not all truncated, or warned."""
        if self.warned or not all_truncated(metrics):
            return None
        self.warned = True
        stop_line = describe_stop_ids(self.tokenizer, eos_token_ids(self.tokenizer, self.model_dir))
        return all_truncated_message(step, stop_line, self.max_response_length)


__all__ = ["TruncationWatch", "all_truncated", "all_truncated_message"]

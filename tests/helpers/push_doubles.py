"""An engine double for the push check's bf16 tests: what a push leaves in vLLM, as far as the check sees it
(`score`, `group_outputs` for the localisation, through vLLM's recorder, `weight_dtype`), on a bf16 copy of the
policy."""

from __future__ import annotations

import copy

import torch


class ScoringEngine:
    """The HF model's own forward (its caps included) on a copy of `model` in `weight_dtype`: any family."""

    weight_dtype = torch.float32

    def __init__(self, model):
        self.model = copy.deepcopy(model).to(self.weight_dtype)
        self.llm = self

    def apply_model(self, fn):
        return [fn(self.model)]

    def group_outputs(self, sequence, model_type):
        from flashdapo.sync.vllm import vllm_group_outputs

        return vllm_group_outputs(self, lambda: self.score([sequence]), model_type)

    @torch.no_grad()
    def score(self, sequences):
        ids = torch.tensor(sequences)
        logits = self.model(ids).logits[:, :-1].float()
        return list(torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0])


class BF16ScoringEngine(ScoringEngine):
    """The same on a bf16 copy."""

    weight_dtype = torch.bfloat16

"""A scripted rollout engine and scorer: dynamic sampling without a model."""

import torch

from flashdapo.data import DatasetReport, Prompt, PromptDataset
from flashdapo.reward import Verdict
from flashdapo.rollout import Rollouts


class ScriptedEngine:
    """Response j of a prompt is the tokens [prompt_id, j]; the scorer decides what is correct."""

    def generate(self, prompts, sampling):
        ids = [torch.tensor(p) for p in prompts]
        owners = [i for i in range(len(prompts)) for _ in range(sampling.n)]
        return Rollouts(prompt_ids=[ids[i] for i in owners],
                        response_ids=[torch.tensor([prompts[i][0], j % sampling.n]) for j, i in enumerate(owners)],
                        group_ids=torch.tensor(owners), truncated=torch.zeros(len(owners), dtype=torch.bool))


class PlainTokenizer:
    def batch_decode(self, sequences, skip_special_tokens=True):
        return [self.decode(s) for s in sequences]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def scripted_verifier(informative_ids):
    """Prompts in informative_ids get one correct response (sample 0); all others are all wrong."""
    def verify(text, truth):
        prompt_id, sample = map(int, text.split())
        ok = prompt_id in informative_ids and sample == 0
        return Verdict(1.0 if ok else -1.0, ok, text)
    return verify


def numbered_prompts(count: int) -> PromptDataset:
    prompts = [Prompt(ids=[k], ground_truth="", source=f"t:{k}") for k in range(count)]
    return PromptDataset(prompts, DatasetReport(count, 0, 0, 0, 0))

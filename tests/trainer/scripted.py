"""A scripted rollout engine and scorer: dynamic sampling without a model."""

import torch

from flashdapo.data import DatasetReport, Prompt, PromptDataset
from flashdapo.reward import Verdict
from flashdapo.rollout import Completion, Rollouts


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


class ScriptedStream:
    """A StreamingEngine double: request (prompt p, member m) samples `length(p, m)` tokens, one per step,
    all requests running at once: tokens [p, m, 7, 7, ...], each with log-prob -(version + 1), where
    `version` is set by the test before each stream (it names the weights that sampled the token). The
    collector's request keys are group * n + member."""

    def __init__(self, length, n):
        self.length, self.n, self.version, self.running = length, n, 0, {}

    def open_stream(self, sampling):
        self.running = {}

    def submit(self, requests):
        for r in requests:
            p, m = r.prompt[0], r.key % self.n
            self.running[r.key] = {"p": p, "m": m, "total": self.length(p, m), "done": len(r.prefix),
                                   "versions": [], "limit": r.max_new_tokens + len(r.prefix)}

    def pending(self):
        return len(self.running)

    def step(self):
        out = []
        for key, run in list(self.running.items()):
            run["versions"].append(self.version)
            run["done"] += 1
            if run["done"] >= min(run["total"], run["limit"]):
                out.append(self._completion(key, run, finished=True))
                del self.running[key]
        return out

    def abort(self):
        out = [self._completion(key, run, finished=False) for key, run in self.running.items()]
        self.running = {}
        return out

    def _completion(self, key, run, finished):
        full = [run["p"], run["m"]] + [7] * max(run["total"] - 2, 0)
        new = full[run["done"] - len(run["versions"]):run["done"]]
        return Completion(key, torch.tensor(new, dtype=torch.long),
                          torch.tensor([-(v + 1.0) for v in run["versions"]]), finished=finished,
                          truncated=finished and run["done"] < run["total"])

"""The probe: the policy's entropy and top-1 probability on fixed prompts and fixed responses.

`actor/entropy` is over the tokens a step trains on, so whatever changes which responses train (dynamic
sampling, overlong filtering, the reward) changes it by construction. The probe instead reads the policy on
the same tokens at every step: a fixed set of prompts (the first `logging.probe_prompts` distinct prompts of
the validation split, else of the training data) each with the fixed response "Answer: <reference answer>"
and eos, teacher-forced (no sampling). Per response token it takes the entropy and the top-1 probability
max_v p_v of the policy's next-token distribution at the training temperature, through the kernels'
no-grad forward (`kernels.token_probe_stats`: no [tokens, vocab] logits on the chunked impls), and reports
their means over all probe tokens as probe/entropy and probe/top1_prob, every `logging.probe_every` steps.

Every rank runs the whole (small) probe set, so every rank holds the same figures without a reduction; the
pass is a forward only, draws no random numbers, and leaves the weights and the optimizer alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...data import Prompt
from ...models.policy import PolicyModel

PROBE_RESPONSE = "Answer: {answer}"
"""The fixed response of a probe prompt: the answer line DAPO's prompt asks for, with the reference answer."""


@dataclass(frozen=True)
class ProbeSet:
    """The probe's prompts and their fixed responses (token ids, eos last)."""

    prompts: tuple[torch.Tensor, ...]
    responses: tuple[torch.Tensor, ...]

    def __len__(self) -> int:
        return len(self.prompts)


def build_probe_set(prompts: Sequence[Prompt], tokenizer, size: int) -> ProbeSet:
    """The first `size` distinct prompts (by token ids; evaluation files repeat each problem), in order,
    each with PROBE_RESPONSE of its ground truth followed by the tokenizer's eos."""
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    seen: set[tuple[int, ...]] = set()
    chosen: list[Prompt] = []
    for prompt in prompts:
        if len(chosen) == size:
            break
        if tuple(prompt.ids) not in seen:
            seen.add(tuple(prompt.ids))
            chosen.append(prompt)
    responses = [
        tokenizer.encode(PROBE_RESPONSE.format(answer=p.ground_truth), add_special_tokens=False) + [eos]
        for p in chosen
    ]
    return ProbeSet(prompts=tuple(torch.tensor(p.ids, dtype=torch.long) for p in chosen),
                    responses=tuple(torch.tensor(r, dtype=torch.long) for r in responses))


def probe_due(every: int, step: int) -> bool:
    """Whether step `step` (0: before training) is probed: every `every` steps (0: never). Not at a run's last
    step as such: a run stopped early and resumed then logs the same steps as one that ran straight
    through."""
    return every > 0 and step % every == 0


@torch.no_grad()
def probe_metrics(policy: PolicyModel, probe: ProbeSet, micro_batch_tokens: int, pad_id: int,
                  device: torch.device) -> dict[str, float]:
    """probe/entropy and probe/top1_prob: means over every response token of `probe` (empty set: {})."""
    from ..update import micro_batches  # the update's micro-batching (a dummy where a rank has nothing)

    if not len(probe):
        return {}
    sums = torch.zeros(3, dtype=torch.float64)  # entropy, top-1 probability, tokens
    for indices, prompts, responses in micro_batches(list(probe.prompts), list(probe.responses),
                                                      micro_batch_tokens * policy.sp, pad_id,
                                                      not policy.packed_layout):
        packed = policy.token_batch(prompts, responses, device)
        _, entropy, top1 = policy(packed, probe=True)
        entropy, top1 = (policy.whole_micro_batch(t, packed) for t in (entropy, top1))
        if indices:
            sums += torch.tensor([entropy.double().sum().item(), top1.double().sum().item(), entropy.numel()],
                                 dtype=torch.float64)
    if hasattr(policy, "reshard"):  # FSDP2: a forward without backward leaves the root unsharded (as in
        policy.reshard()            # update.compute_old_logprobs)
    count = max(sums[2].item(), 1.0)
    return {"probe/entropy": sums[0].item() / count, "probe/top1_prob": sums[1].item() / count}

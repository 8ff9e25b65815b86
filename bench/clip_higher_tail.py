"""Which tokens can the upper clip hold back, and would their rise raise entropy? The mechanism behind the A'
panel (docs/ablation.md, "Why temperature 1.5"), measured on a base model at several sampling temperatures.

The upper clip stops the gradient of a token with advantage A > 0 once its ratio passes 1 + eps_high, so a
wider clip lets exactly those tokens rise further. Whether that keeps entropy up depends on where such a token
sits in its position's distribution pi. Raising its logit z_a along the policy gradient e_a - pi changes the
position's entropy H at the rate

    g(a) = dH/dt = -( pi_a (log pi_a + H) - sum_k pi_k^2 (log pi_k + H) )

(t the step along e_a - pi). g(a) > 0 for a token in the tail (pi_a well below exp(-H)): rewarding it spreads
mass, which is the case of an LLM's long tail over a large vocabulary and the paper's argument. g(a) < 0 for a
likely candidate (a digit the model already prefers among a few): rewarding it concentrates mass, and freeing
it lowers entropy.

The script samples `--prompts` training prompts x `--n` responses with the base at each temperature (top_p 1,
as training samples), teacher-forces them at the same temperature, and reports over the sampled response tokens
that the upper clip can act on at all (pi_a < 1 / (1 + eps_high): a likelier token cannot reach the bound) the
share with g > 0 and the mean g, by probability bucket. No training runs: per temperature, one generate call
per prompt and one teacher-forced forward per response (its full-vocabulary logits, which g needs).

    python -m bench.clip_higher_tail --base runs/ablate/base-TAG --train runs/ablate/data-TAG/train.jsonl
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

BUCKETS = (0.0, 0.05, 0.2, 0.5, 1.0 / 1.2)
"""Old-probability buckets of the up-clippable tokens (the last edge: the most a token can have and still be
up-clipped at eps_high 0.2)."""


@dataclass(frozen=True)
class TokenStats:
    """Per sampled response token: its probability, its position's entropy and g (see the module doc)."""

    prob: torch.Tensor
    entropy: torch.Tensor
    rate: torch.Tensor


def entropy_rate(logits: torch.Tensor, targets: torch.Tensor) -> TokenStats:
    """pi_a, H and g(a) per row of `logits` [T, V] (already divided by the temperature), in float64."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    f = p * (logp + entropy[:, None])  # pi_k (log pi_k + H)
    f_a = f.gather(1, targets[:, None]).squeeze(1)
    rate = -(f_a - (p * f).sum(-1))
    return TokenStats(prob=p.gather(1, targets[:, None]).squeeze(1), entropy=entropy, rate=rate)


def sampled_token_stats(model, tokenizer, prompts: list[list[int]], n: int, temperature: float, max_new: int,
                        seed: int) -> TokenStats:
    """Sample n responses per prompt at `temperature` (top_p 1) and return the stats of every response token."""
    torch.manual_seed(seed)
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    parts = []
    for ids in prompts:
        prompt = torch.tensor([ids])
        out = model.generate(prompt, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                             max_new_tokens=max_new, num_return_sequences=n, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id)
        for row in out:
            response = row[prompt.shape[1]:]
            stop = (response == eos).nonzero()
            response = response[:int(stop[0]) + 1] if len(stop) else response
            full = torch.cat([prompt[0], response])[None]
            with torch.no_grad():
                logits = model(full).logits[0, prompt.shape[1] - 1:-1] / temperature
            parts.append(entropy_rate(logits, response))
    return TokenStats(*(torch.cat([getattr(s, k) for s in parts]) for k in ("prob", "entropy", "rate")))


def report(stats: TokenStats, temperature: float, eps_high: float = 0.2) -> list[str]:
    """Markdown rows: all tokens, the up-clippable ones, and those by probability bucket."""
    rows = []
    clippable = stats.prob < 1.0 / (1.0 + eps_high)

    def row(name: str, mask: torch.Tensor) -> str:
        count = int(mask.sum())
        if count == 0:
            return f"| {temperature:g} | {name} | 0 | | | |"
        share = count / len(stats.prob)
        raising = float((stats.rate[mask] > 0).double().mean())
        return (f"| {temperature:g} | {name} | {count} ({share:.1%}) | {float(stats.entropy[mask].mean()):.3f} | "
                f"{raising:.1%} | {float(stats.rate[mask].mean()):+.4f} |")

    rows.append(row("all sampled tokens", torch.ones_like(clippable)))
    rows.append(row(f"up-clippable (pi_a < {1 / (1 + eps_high):.3f})", clippable))
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        rows.append(row(f"  pi_a in [{lo:.2f}, {hi:.2f})", clippable & (stats.prob >= lo) & (stats.prob < hi)))
    return rows


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashdapo.data import chat_ids

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the base model directory (HF: model and tokenizer)")
    p.add_argument("--train", required=True, help="training problems, DAPO-schema jsonl (ablate's data-TAG/)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 1.5])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    lines = Path(args.train).read_text(encoding="utf-8").splitlines()[:args.prompts]
    prompts = [chat_ids(tokenizer, json.loads(line)["prompt"]) for line in lines]
    print(f"base {args.base}: {len(prompts)} prompts x {args.n} responses per temperature, top_p 1.0")
    print("| temperature | tokens | count (share) | mean H at those positions | share with g > 0 | mean g |")
    print("|---|---|---|---|---|---|")
    for t in args.temperatures:
        stats = sampled_token_stats(model, tokenizer, prompts, args.n, t, args.max_new_tokens, args.seed)
        print("\n".join(report(stats, t)), flush=True)


if __name__ == "__main__":
    main()

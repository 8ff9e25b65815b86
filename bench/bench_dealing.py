"""How evenly the step's tokens fall on the data-parallel slots: mean / max slot tokens per mini-batch (1.0 =
every slot as busy as the busiest; a step waits for the busiest) for three dealings of one global mini-batch:

  contiguous   each slot takes its contiguous run of whole groups (the dealing before token balancing)
  groups       whole groups, longest first to the least-loaded slot with room (equal group counts)
  responses    flashdapo's dealing (flashdapo.trainer.collect.dealing.balance): responses, longest first

Lengths are synthetic, stated here: per prompt a typical response length L_p ~ LogNormal(log 4000, 0.6) (prompts
differ in difficulty), per response LogNormal(log L_p, 0.5), capped at the 20480-token limit, plus a 200-token
prompt. The released 32B recipe's layout by default: 16 slots, 32 groups per mini-batch, 16 responses each.

  python -m bench.bench_dealing [--slots 16] [--groups 32] [--n 16] [--trials 200]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flashdapo.trainer.collect.dealing import balance, slot_loads


def synthetic_costs(groups: int, n: int, generator: torch.Generator) -> list[list[int]]:
    """Tokens (prompt + response) of every response of `groups` groups of `n` (see the module docstring)."""
    typical = torch.exp(torch.log(torch.tensor(4000.0)) + 0.6 * torch.randn(groups, 1, generator=generator))
    lengths = torch.exp(torch.log(typical) + 0.5 * torch.randn(groups, n, generator=generator)).clamp(max=20480)
    return (lengths.round().long() + 200).tolist()


def contiguous(costs: list[list[int]], slots: int) -> list[int]:
    per = len(costs) // slots
    return [sum(sum(g) for g in costs[s * per:(s + 1) * per]) for s in range(slots)]


def whole_groups(costs: list[list[int]], slots: int) -> list[int]:
    per, loads, counts = len(costs) // slots, [0] * slots, [0] * slots
    for total in sorted((sum(g) for g in costs), reverse=True):
        target = min((s for s in range(slots) if counts[s] < per), key=lambda s: (loads[s], s))
        loads[target] += total
        counts[target] += 1
    return loads


def responses(costs: list[list[int]], slots: int) -> list[int]:
    return slot_loads(costs, balance(costs, slots), slots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    dealings = {"contiguous": contiguous, "groups": whole_groups, "responses": responses}
    if args.groups < args.slots:  # whole groups leave slots empty: only responses can be dealt (e.g. 7B on 16 x 8)
        dealings = {"responses": responses}
    ratios: dict[str, list[float]] = {name: [] for name in dealings}
    for _ in range(args.trials):
        costs = synthetic_costs(args.groups, args.n, generator)
        for name, deal in dealings.items():
            loads = deal(costs, args.slots)
            ratios[name].append(statistics.mean(loads) / max(loads))
    print(f"{args.slots} slots, {args.groups} groups x {args.n} responses per mini-batch, {args.trials} trials: "
          "mean / max slot tokens (mean over trials, worst trial)")
    for name, values in ratios.items():
        print(f"  {name:<11} {statistics.mean(values):.3f}  (worst {min(values):.3f})")


if __name__ == "__main__":
    main()

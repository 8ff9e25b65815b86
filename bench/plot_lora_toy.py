"""Plot toy runs side by side (docs/lora_toy.png): validation mean@k and the sampled tokens' entropy per step.

    python -m bench.plot_lora_toy OUT.png "full training=runs/full" "LoRA r8=runs/lora" ...

Each RUN_DIR is a `flashdapo train` run directory (its metrics.jsonl); a later row of a step (a resumed run)
replaces an earlier one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def series(run_dir: Path, key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` in the run's metrics.jsonl, the last row of each step."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if key in row:
            by_step[row["step"]] = row[key]
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in arg for arg in argv[1:]):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (val, ent) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arg in argv[1:]:
        label, run_dir = arg.split("=", 1)
        line, = val.plot(*series(Path(run_dir), "val/acc/mean@k"), label=label, marker="o", ms=3)
        ent.plot(*series(Path(run_dir), "actor/entropy"), color=line.get_color(), lw=1, label=label)
    val.axhline(0.8, color="r", lw=0.6, ls=":")
    val.set(xlabel="step", ylabel="validation mean@k", title="validation")
    ent.set(xlabel="step", ylabel="entropy of sampled tokens", title="policy entropy")
    val.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(argv[0], dpi=110)
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

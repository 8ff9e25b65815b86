"""The demo on a quiet vs a busy CPU: wall time of `flashdapo train` (toy preset), alone and next to one
CPU-bound competitor that this script starts itself, alternated within one run.

    python -m bench.bench_busy [--steps 40] [--repeats 3] [--competitor python|torch] [--out DIR]

Each repeat runs the demo once alone, then once with the competitor (started just before, killed
just after), each in a fresh process. The competitor is `python`: one pure-Python busy loop (one
CPU-bound thread), or `torch`: a loop of 512x512 matmuls with torch's default threads (another torch
job, e.g. a test run). The ratio busy/quiet is reported per pair and as the median, with the load
average before each run, since other jobs on the machine add their own noise. `--steps` shortens the
demo (warm-up, validations and checkpoints are those of the preset).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPETITORS = {
    "python": "while True:\n    pass",
    "torch": "import torch\na = torch.randn(512, 512)\nwhile True:\n    a @ a",
}


def run_demo(steps: int, extra: list[str]) -> float:
    """Wall seconds of one `flashdapo train` of the toy preset, `steps` steps, in a fresh process."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "flashdapo", "train", "--trainer.total-steps", str(steps),
               "--logging.run-dir", run_dir, "--logging.progress", "False", *extra]
        start = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - start


def run_busy(steps: int, competitor: str, extra: list[str]) -> float:
    """Like run_demo, with the competitor running for the whole demo."""
    rival = subprocess.Popen([sys.executable, "-c", COMPETITORS[competitor]])
    try:
        time.sleep(1.0)  # let it start (and import torch) before the demo does
        return run_demo(steps, extra)
    finally:
        rival.kill()
        rival.wait()


def main(argv=None) -> int:
    from bench.bench_kernels import git_commit, machine_tag

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="DAPO steps of the demo (the preset has 240)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--competitor", choices=sorted(COMPETITORS), default="python")
    parser.add_argument("--out", default=None, help="also write the table to DIR/<date>-<machine>-<commit>-busy.md")
    parser.add_argument("extra", nargs="*", help="more `flashdapo train` arguments (after --)")
    args = parser.parse_args(argv)
    commit = git_commit()
    rows = []
    for rep in range(args.repeats):
        load_q = os.getloadavg()[0]
        quiet = run_demo(args.steps, args.extra)
        load_b = os.getloadavg()[0]
        busy = run_busy(args.steps, args.competitor, args.extra)
        rows.append((quiet, busy, load_q, load_b))
        print(f"repeat {rep}: quiet {quiet:.1f} s (load {load_q:.1f}), busy {busy:.1f} s (load {load_b:.1f}), "
              f"ratio {busy / quiet:.2f}", file=sys.stderr, flush=True)
    ratios = [b / q for q, b, _, _ in rows]
    lines = [f"# Demo quiet vs busy: {machine_tag('cpu')}, commit {commit}, {datetime.date.today()}", "",
             f"`flashdapo train` (toy preset, {args.steps} steps{', ' + ' '.join(args.extra) if args.extra else ''}); "
             f"competitor: {args.competitor}; load average (1 min) before each run.", "",
             "| repeat | quiet s | busy s | busy / quiet | load before quiet | load before busy |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {i} | {q:.1f} | {b:.1f} | {b / q:.2f} | {lq:.1f} | {lb:.1f} |" for i, (q, b, lq, lb) in enumerate(rows)]
    lines += ["", f"median quiet {statistics.median(r[0] for r in rows):.1f} s, median busy "
              f"{statistics.median(r[1] for r in rows):.1f} s, median ratio {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})"]
    table = "\n".join(lines)
    print(table)
    if args.out:
        path = Path(args.out) / f"{datetime.date.today()}-{machine_tag('cpu')}-{commit}-busy.md"
        path.write_text(table + "\n")
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""trainer.batch_invariant against the default, end to end: `flashdapo train` of the same model and batch,
with and without `--trainer.batch-invariant true --algorithm.old-logprobs rollout`, on this machine.

Workloads (the torch engine, 1 rank, a fresh process per run, `--steps` steps, no validation between steps,
no checkpoint):

- the built-in toy with its defaults (dynamic sampling on, gen batch 48, n 8);
- bench_lora's random Qwen2-shaped model with Qwen2.5's vocabulary (151,936 tokens, hidden 256, 4 layers,
  40.7M parameters) and the toy task's tokenizer and prompts, fp32, with bench_lora's settings (dynamic
  sampling off, gen batch 32, prompts up to 32 tokens).

Per run: the median over steps 2.. (step 1 carries the one-time costs) of `timing_s/gen`,
`timing_s/update_actor`, `timing_s/old_log_prob` and `timing_s/step` from metrics.jsonl, generation seconds
per 1,000 generated tokens (dynamic sampling varies the number of generation rounds), the process's peak
resident set size, and `rollout/logprob_exact_fraction` / `rollout/logprob_abs_diff_max` at the steps that
logged them (the log-prob check: step 1, then every `rollout.logprob_check_every` = 10 steps). With
batch_invariant and old_logprobs=rollout the old-log-prob pass runs only on those check steps (it is the exact
check), so its median is given over the steps 2.. that are not check steps, and the check steps' own times
apart. The arms alternate (default, invariant, invariant, default, ...) over `--repeats` repeats, so that a pair
shares the machine's load; the table gives the median [min, max] of the invariant / default ratio of the paired
runs, and each arm's median.

`--profile-steps N` (default 3; 0: none) then runs one toy run of each arm (`--profile-qwen`: and of the
Qwen-vocabulary model) under cProfile, enabled only inside `TorchEngine.generate` of training steps 2..N, and
reports the functions that take the generation time, and the invariant attention's prefill / decode split.

A shared 2-core CPU: ratios within a run, never absolute figures across runs; not a GPU prediction.

    python -m bench.bench_exact [--repeats 2] [--steps 6] [--profile-steps 3] [--profile-qwen] [--no-qwen]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bench_lora import (
    REPO,
    _child,
    _commit,
    _median,
    _publish,
    _qwen_vocab_model,
    _ratio_cell,
    _toy_problems,
)
from flashdapo.config import RolloutConfig
from flashdapo.trainer.observe.logprob_check import should_check_logprobs

TIMINGS = ("timing_s/gen", "timing_s/update_actor", "timing_s/old_log_prob", "timing_s/step")
EXACT = ("rollout/logprob_exact_fraction", "rollout/logprob_abs_diff_max")
INVARIANT = ["--trainer.batch-invariant", "true", "--algorithm.old-logprobs", "rollout"]
CHECK_EVERY = RolloutConfig().logprob_check_every
"""The log-prob check's schedule in these runs (they leave rollout.logprob_check_every at its default)."""
COMMON = ["--trainer.val-every", "0", "--trainer.val-before-train", "false", "--checkpoint.save-every", "0",
          "--checkpoint.export-hf", "false", "--logging.plot", "false", "--logging.progress", "false"]
QWEN_SETTINGS = ["--algorithm.dynamic-sampling", "false", "--trainer.gen-batch", "32", "--model.dtype",
                 "float32", "--data.max-prompt-length", "32"]
PROFILED = {
    "policy forward (the decoder; default: + the LM head, 1 position)": ("models/policy.py", "forward"),
    "attention (packing._packed_attention, all)": ("models/packing.py", "_packed_attention"),
    "invariant_attention (kernels/invariant.py)": ("kernels/invariant.py", "invariant_attention"),
    "  its block(): the key / value gathers": ("kernels/invariant.py", "block"),
    "attention_extents (kernels/invariant.py)": ("kernels/invariant.py", "attention_extents"),
    "_boolean_mask (models/invariant.py: the materialized mask)": ("models/invariant.py", "_boolean_mask"),
    "sdpa_attention_forward (default attention)": ("sdpa_attention.py", "sdpa_attention_forward"),
    "invariant_linear (kernels/invariant.py)": ("kernels/invariant.py", "invariant_linear"),
    "F.linear (default linears)": ("~", "<built-in method torch._C._nn.linear>"),
    "sampling_logits (policy.py: the row-tiled LM head, in the engine's _forward)": ("models/policy.py",
                                                                                     "sampling_logits"),
    "_invariant_sample (rollout/torch_engine.py)": ("rollout/torch_engine.py", "_invariant_sample"),
    "  sampled_logprobs (policy.py: token_logprobs invariant=True)": ("models/policy.py", "sampled_logprobs"),
    "sample (rollout/torch_engine.py: the draw)": ("rollout/torch_engine.py", "sample"),
}
"""Report row -> (file suffix, function name), or ("~", a builtin's printed name), in the generation profile."""


def _is_check(step: int) -> bool:
    return should_check_logprobs(step, CHECK_EVERY, 1)  # the loop's own schedule


def _run(run_dir: Path, args: list[str]) -> dict:
    """One `flashdapo train ARGS` in a fresh process: medians over steps 2.., the check steps' figures."""
    proc = subprocess.run([sys.executable, "-m", "bench.bench_exact", "--child", *args, "--logging.run-dir",
                           str(run_dir)], capture_output=True, text=True, cwd=REPO, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r]
    later = [r for r in rows if r["step"] >= 2]
    out: dict = {key: statistics.median(r[key] for r in later) for key in TIMINGS if all(key in r for r in later)}
    between = [r["timing_s/old_log_prob"] for r in later if not _is_check(int(r["step"]))]
    out["old_log_prob_between"] = statistics.median(between) if between else None
    out["old_log_prob_checks"] = {int(r["step"]): r["timing_s/old_log_prob"] for r in rows
                                  if _is_check(int(r["step"]))}
    out["gen_per_ktok"] = statistics.median(1000 * r["timing_s/gen"] / r["train/generated_tokens"] for r in later)
    out["gen_batches"] = statistics.median(r["train/num_gen_batches"] for r in later)
    out["exact"] = {int(r["step"]): tuple(r[k] for k in EXACT) for r in rows if all(k in r for k in EXACT)}
    out["peak_gib"] = int(proc.stdout.split("BENCH_PEAK_KIB ")[1].split()[0]) / 2**20
    return out


def _profile_child(out: str, argv: list[str]) -> None:
    """`flashdapo train ARGV` in this process with cProfile enabled only inside `TorchEngine.generate` during
    training steps 2.. (not step 1's one-time costs, not the final validation); the stats dumped to `out`,
    and the batch-invariant attention's wall time split into prefill (queries > 1) and decode calls."""
    import time

    from flashdapo.models import invariant
    from flashdapo.rollout.torch_engine import TorchEngine
    from flashdapo.trainer import loop

    profiler = cProfile.Profile()
    state = {"step": 0, "calls": 0, "generating": False}
    attention = {"prefill": [0.0, 0], "decode": [0.0, 0]}
    train_step, generate, attend = loop.train_step, TorchEngine.generate, invariant.invariant_attention

    def counted_step(run, step):
        state["step"] = step
        try:
            return train_step(run, step)
        finally:
            state["step"] = 0

    def profiled_generate(self, *args, **kwargs):
        if state["step"] < 2:
            return generate(self, *args, **kwargs)
        state["calls"] += 1
        state["generating"] = True
        profiler.enable()
        try:
            return generate(self, *args, **kwargs)
        finally:
            profiler.disable()
            state["generating"] = False

    def timed_attention(query, *args, **kwargs):
        start = time.perf_counter()
        try:
            return attend(query, *args, **kwargs)
        finally:
            if state["generating"]:
                kind = attention["prefill" if query.shape[2] > 1 else "decode"]
                kind[0] += time.perf_counter() - start
                kind[1] += 1

    loop.train_step, TorchEngine.generate, invariant.invariant_attention = (counted_step, profiled_generate,
                                                                            timed_attention)
    _child(argv)
    profiler.dump_stats(out)
    print(f"BENCH_GENERATE_CALLS {state['calls']}", flush=True)
    print(f"BENCH_ATTENTION {json.dumps(attention)}", flush=True)


def _profile(tmp: Path, args: list[str]) -> dict:
    """The generation profile of one run: cumulative seconds of the functions in PROFILED and the top functions
    by own time, against `TorchEngine.generate`'s total."""
    tmp.mkdir()
    stats_file = tmp / "gen.prof"
    proc = subprocess.run([sys.executable, "-m", "bench.bench_exact", "--profile-child", str(stats_file), *args,
                           "--logging.run-dir", str(tmp / "run")], capture_output=True, text=True, cwd=REPO,
                          timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"profile {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    raw = pstats.Stats(str(stats_file)).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)

    def cumulative(where: str, name: str) -> float:
        return sum(v[3] for k, v in raw.items() if k[2] == name and k[0].endswith(where))

    own = sorted(((k[2] if k[0] == "~" else f"{Path(k[0]).name}:{k[2]}", v[2], v[1]) for k, v in raw.items()),
                 key=lambda t: -t[1])[:12]
    return {"total": cumulative("rollout/torch_engine.py", "generate"),
            "calls": int(proc.stdout.split("BENCH_GENERATE_CALLS ")[1].split()[0]),
            "attention": json.loads(proc.stdout.split("BENCH_ATTENTION ")[1].splitlines()[0]),
            "cum": {label: cumulative(*where) for label, where in PROFILED.items()}, "own": own}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2:])
    if sys.argv[1:2] == ["--profile-child"]:
        return _profile_child(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--profile-qwen", action="store_true", help="profile the Qwen-vocabulary model too")
    parser.add_argument("--no-qwen", action="store_true")
    opts = parser.parse_args()
    steps = ["--trainer.total-steps", str(opts.steps)]
    results: dict[str, list[tuple[dict, dict]]] = {}
    profiles: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        setups = {"toy, torch engine": []}
        if not opts.no_qwen:
            qwen = str(_qwen_vocab_model(Path(tmp) / "qwen-vocab"))
            data = str(_toy_problems(Path(tmp) / "toy.jsonl"))
            setups["Qwen vocabulary, torch engine"] = ["--model.path", qwen, "--data.train-files", data,
                                                       *QWEN_SETTINGS]
        for s, (name, args) in enumerate(setups.items()):
            pairs = []
            for repeat in range(opts.repeats):
                arms = {}
                for arm in (("default", "invariant") if repeat % 2 == 0 else ("invariant", "default")):
                    extra = INVARIANT if arm == "invariant" else []
                    arms[arm] = _run(Path(tmp) / f"run-{s}-{repeat}-{arm}", [*COMMON, *steps, *args, *extra])
                    print(name, repeat, arm, arms[arm], flush=True)
                pairs.append((arms["default"], arms["invariant"]))
            results[name] = pairs
        if opts.profile_steps >= 2:
            for s, (name, args) in enumerate(setups.items()):
                if s and not opts.profile_qwen:
                    continue
                profiles[name] = {}
                for arm, extra in (("default", []), ("invariant", INVARIANT)):
                    profiles[name][arm] = p = _profile(
                        Path(tmp) / f"profile-{s}-{arm}",
                        [*COMMON, "--trainer.total-steps", str(opts.profile_steps), *args, *extra])
                    print("profile", name, arm, p["total"], p["calls"], p["attention"], flush=True)
    _report(results, profiles, opts)


def _cell(pairs: list[tuple[dict, dict]], key: str, fmt: str = "{:.3f}") -> list[str]:
    default = [d for d, _ in pairs]
    inv = [i for _, i in pairs]
    return [f"{_median(default, key, fmt=fmt)} / {_median(inv, key, fmt=fmt)}", _ratio_cell(pairs, key)]


def _report(results: dict[str, list[tuple[dict, dict]]], profiles: dict[str, dict[str, dict]], opts) -> None:
    commit = _commit()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "flashdapo"], capture_output=True, text=True,
                           cwd=REPO).stdout.split("\n")
    dirty = [line[3:] for line in dirty if line.strip()]
    sys.path.insert(0, str(REPO))
    from flashdapo.tools.machine import machine_summary

    command = (f"python -m bench.bench_exact --repeats {opts.repeats} --steps {opts.steps} --profile-steps "
               f"{opts.profile_steps}" + (" --profile-qwen" if opts.profile_qwen else "")
               + (" --no-qwen" if opts.no_qwen else ""))
    lines = [f"# trainer.batch_invariant vs default, {datetime.date.today()}, commit {commit}", "",
             machine_summary(), "",
             *([f"Measured with uncommitted changes to {', '.join(dirty)} (on top of {commit}).", ""] if dirty
               else []),
             f"`{command}`: medians over steps 2.., ratio invariant / default of paired runs, median [min, max] "
             "over repeats. Invariant: `--trainer.batch-invariant true --algorithm.old-logprobs rollout`.", "",
             "| setup | step s (default / inv.) | step ratio | gen s | gen ratio | gen s per 1k tokens | "
             "gen/token ratio | update s | update ratio | old-log-prob s, non-check steps | old-log-prob "
             "ratio | peak GiB | peak ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, pairs in results.items():
        cells = [*_cell(pairs, "timing_s/step"), *_cell(pairs, "timing_s/gen"), *_cell(pairs, "gen_per_ktok"),
                 *_cell(pairs, "timing_s/update_actor"), *_cell(pairs, "old_log_prob_between"),
                 *_cell(pairs, "peak_gib", "{:.2f}")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    checks = [s for s in range(1, opts.steps + 1) if _is_check(s)]
    lines += ["", "The invariant runs skip the old-log-prob pass except on the log-prob check's steps (step 1, "
              f"then every {CHECK_EVERY}: here step{'s' if len(checks) > 1 else ''} "
              f"{', '.join(map(str, checks))}" + (", which the medians over steps 2.. leave out"
                                                  if checks == [1] else "")
              + "). old_log_prob at the check steps, s (default / invariant), one entry per repeat:", ""]
    for name, pairs in results.items():
        entries = "; ".join(", ".join(f"step {s}: {d['old_log_prob_checks'].get(s, float('nan')):.3f} / "
                                      f"{i['old_log_prob_checks'].get(s, float('nan')):.3f}" for s in checks)
                            for d, i in pairs)
        lines.append(f"- {name}: {entries}")
    lines += ["", "Generation rounds per step (median, default / invariant): "
              + "; ".join(f"{name}: {_median([d for d, _ in p], 'gen_batches', fmt='{:.1f}')} / "
                          f"{_median([i for _, i in p], 'gen_batches', fmt='{:.1f}')}" for name, p in results.items()),
              "", "## Exactness (the log-prob check's steps)", "",
              "| setup | arm | repeat | step | logprob_exact_fraction | logprob_abs_diff_max |",
              "|---|---|---|---|---|---|"]
    for name, pairs in results.items():
        for repeat, (d, i) in enumerate(pairs):
            for arm, run in (("default", d), ("invariant", i)):
                for step, (exact, diff) in run["exact"].items():
                    lines.append(f"| {name} | {arm} | {repeat} | {step} | {exact:.6f} | {diff:.3g} |")
    for name, arms in profiles.items():
        d, i = arms["default"], arms["invariant"]
        lines += ["", f"## Where the generation time goes ({name}, cProfile, training steps 2..{opts.profile_steps})",
                  "", "cProfile enabled only inside `TorchEngine.generate` (its per-call overhead inflates "
                  "Python-heavy code: read shares, not seconds). Cumulative seconds and share of generate's "
                  "total; indented rows are inside the row above:", "",
                  "| function | default s | default share | invariant s | invariant share |",
                  "|---|---|---|---|---|",
                  f"| TorchEngine.generate ({d['calls']} / {i['calls']} calls) | {d['total']:.2f} | 100% | "
                  f"{i['total']:.2f} | 100% |"]
        for label in PROFILED:
            cells = []
            for p in (d, i):
                v = p["cum"][label]
                cells += [f"{v:.2f}", f"{100 * v / p['total']:.0f}%"] if v else ["-", "-"]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        att = i["attention"]
        lines += ["", "invariant_attention wall time (under the profiler) by call: prefill (queries > 1) "
                  f"{att['prefill'][0]:.2f} s in {att['prefill'][1]} calls, decode {att['decode'][0]:.2f} s in "
                  f"{att['decode'][1]} calls."]
        for arm, p in arms.items():
            lines += ["", f"Top own time (tottime), {arm}:", "", "| function | s | share | calls |",
                      "|---|---|---|---|"]
            lines += [f"| `{fn}` | {t:.2f} | {100 * t / p['total']:.0f}% | {calls} |" for fn, t, calls in p["own"]]
    _publish("\n".join(lines) + "\n", f"{commit}{'-dirty' if dirty else ''}", "exact")


if __name__ == "__main__":
    main()

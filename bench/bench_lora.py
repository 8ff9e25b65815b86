"""LoRA against full training, end to end: `flashdapo train` of the same model and batch, with and without
`--lora.rank`, on this machine.

Models: the built-in toy (117k parameters, vocabulary 20), and a random Qwen2-shaped model with Qwen2.5's
vocabulary (151,936 tokens, hidden 256, 4 layers, tied embeddings: 40.7M parameters, 39M of them the
embedding), saved as a model directory with the toy task's tokenizer, trained on
the toy task's prompts (random: its responses run to the toy preset's limit of 10 tokens). Engines: the torch engine for both models; vLLM's CPU build for the Qwen-vocabulary model
(co-located, 1 rank), which is where a push crosses from the trainer into another copy of the weights.

Per run (`flashdapo train`, 1 rank, a fresh process; `--steps` steps, no validation, no checkpoint): the median
over steps 2.. of `timing_s/step`, `timing_s/update_actor` and `timing_s/weight_sync` from metrics.jsonl; the
process's peak resident set size (VmHWM at exit: the whole process, model load and warm-up included); with
vLLM, the bytes of each push (`rollout/push_bytes` when the engine logs it). The arms alternate (full, LoRA,
LoRA, full, ...) over `--repeats` repeats, so that a pair shares the machine's load; the table gives the
median [min, max] of the LoRA / full ratio of the paired runs, and each arm's median.

A shared 2-core CPU: ratios within a run, never absolute figures across runs; not a GPU prediction.

    python -m bench.bench_lora [--repeats 3] [--steps 6] [--no-vllm] [--rank 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QWEN_VOCAB = 151_936
METRICS = ("timing_s/step", "timing_s/update_actor", "timing_s/weight_sync", "rollout/push_bytes")


def _qwen_vocab_model(path: Path) -> Path:
    """A random Qwen2-shaped model with Qwen2.5's vocabulary and the toy task's tokenizer, saved at `path`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from flashdapo.config import ToyTaskConfig
    from flashdapo.tasks.toy import build_toy_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    build_toy_tokenizer(ToyTaskConfig()).save_pretrained(path)
    return path


def _toy_problems(path: Path, rows: int = 100) -> Path:
    """The toy task's problems as a DAPO-schema jsonl (the Qwen-vocabulary model's training data)."""
    from flashdapo.config import ToyTaskConfig
    from flashdapo.tasks.toy import toy_records

    path.write_text("".join(json.dumps({"prompt": r.messages, "reward_model": {"ground_truth": r.ground_truth}})
                            + "\n" for r in toy_records(ToyTaskConfig(num_val=rows), "val")))
    return path


def _child(argv: list[str]) -> None:
    """Run `flashdapo train ARGV` in this process, then print its peak resident set size (KiB)."""
    from flashdapo.__main__ import main

    code = main(["train", *argv])
    if code:
        sys.exit(code)
    peak = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
    print(f"BENCH_PEAK_KIB {int(peak.split()[1])}", flush=True)


def _run(run_dir: Path, args: list[str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-m", "bench.bench_lora", "--child", *args, "--logging.run-dir",
                           str(run_dir)], capture_output=True, text=True, cwd=REPO, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 2 and "timing_s/step" in r]
    out = {key: statistics.median(r[key] for r in rows) for key in METRICS if all(key in r for r in rows)}
    out["peak_gib"] = int(proc.stdout.split("BENCH_PEAK_KIB ")[1].split()[0]) / 2**20
    return out


def _ratio_cell(pairs: list[tuple[dict, dict]], key: str) -> str:
    ratios = [lora[key] / full[key] for full, lora in pairs if full.get(key) and key in lora]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"


def _median(runs: list[dict], key: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    values = [r[key] * scale for r in runs if key in r]
    return fmt.format(statistics.median(values)) if values else "-"


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--no-vllm", action="store_true")
    opts = parser.parse_args()
    common = ["--trainer.total-steps", str(opts.steps), "--trainer.val-every", "0", "--trainer.val-before-train",
              "false", "--checkpoint.save-every", "0", "--checkpoint.export-hf", "false", "--logging.plot", "false",
              "--logging.progress", "false", "--algorithm.dynamic-sampling", "false", "--trainer.gen-batch", "32"]
    with tempfile.TemporaryDirectory() as tmp:
        qwen = str(_qwen_vocab_model(Path(tmp) / "qwen-vocab"))
        data = str(_toy_problems(Path(tmp) / "toy.jsonl"))
        qwen_args = ["--model.path", qwen, "--data.train-files", data, "--data.max-prompt-length", "32"]
        setups = {"toy, torch engine": [], "Qwen vocabulary, torch engine": qwen_args}
        if not opts.no_vllm:
            setups["Qwen vocabulary, vLLM CPU"] = [*qwen_args, "--rollout.engine", "vllm"]
        results: dict[str, list[tuple[dict, dict]]] = {}
        for s, (name, args) in enumerate(setups.items()):
            pairs = []
            for repeat in range(opts.repeats):
                arms = {}
                for arm in (("full", "lora") if repeat % 2 == 0 else ("lora", "full")):
                    lora = ["--lora.rank", str(opts.rank)] if arm == "lora" else []
                    arms[arm] = _run(Path(tmp) / f"run-{s}-{repeat}-{arm}", [*common, *args, *lora])
                    print(name, repeat, arm, arms[arm], flush=True)
                pairs.append((arms["full"], arms["lora"]))
            results[name] = pairs
    _report(results, opts)


def _commit() -> str:
    """The checkout's short commit hash (what a results file is named and headed by)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=REPO).stdout.strip()


def _publish(text: str, stem: str, topic: str) -> None:
    """Print a results table and write it to bench/results/<date>-cpu-2core-<stem>-<topic>.md."""
    print(text)
    out = REPO / "bench" / "results" / f"{datetime.date.today()}-cpu-2core-{stem}-{topic}.md"
    out.write_text(text)
    print(f"wrote {out}")


def _report(results: dict[str, list[tuple[dict, dict]]], opts) -> None:
    commit = _commit()
    sys.path.insert(0, str(REPO))
    from flashdapo.tools.machine import machine_summary

    lines = [f"# LoRA (rank {opts.rank}) vs full training, {datetime.date.today()}, commit {commit}", "",
             machine_summary(), "",
             f"`python -m bench.bench_lora --repeats {opts.repeats} --steps {opts.steps}`: medians over steps "
             "2.., ratio LoRA / full of paired runs, median [min, max] over repeats.", "",
             "| setup | step s (full / LoRA) | step ratio | update s (full / LoRA) | update ratio | "
             "push s (full / LoRA) | push bytes (full / LoRA) | peak GiB (full / LoRA) | peak ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, pairs in results.items():
        full = [f for f, _ in pairs]
        lora = [lo for _, lo in pairs]
        cells = [
            f"{_median(full, 'timing_s/step')} / {_median(lora, 'timing_s/step')}",
            _ratio_cell(pairs, "timing_s/step"),
            f"{_median(full, 'timing_s/update_actor')} / {_median(lora, 'timing_s/update_actor')}",
            _ratio_cell(pairs, "timing_s/update_actor"),
            f"{_median(full, 'timing_s/weight_sync')} / {_median(lora, 'timing_s/weight_sync')}",
            f"{_median(full, 'rollout/push_bytes', 2**-20, '{:.2f} MiB')} / "
            f"{_median(lora, 'rollout/push_bytes', 2**-20, '{:.2f} MiB')}",
            f"{_median(full, 'peak_gib', fmt='{:.2f}')} / {_median(lora, 'peak_gib', fmt='{:.2f}')}",
            _ratio_cell(pairs, "peak_gib"),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    _publish("\n".join(lines) + "\n", commit, "lora")


if __name__ == "__main__":
    main()

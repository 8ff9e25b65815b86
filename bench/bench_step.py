"""End-to-end DAPO step benchmark: flashdapo's `train_step`, and TRL's GRPOTrainer on the same workload.

A workload is a random-init HF Qwen2 model (built from a `Qwen2Config`, saved once to a temporary
checkpoint directory that both frameworks load: same initial weights), a fixed set of prompts (toy
addition problems, tokenized by the toy tokenizer's chat template), `n` completions per
prompt of at most `max_new_tokens` tokens, and a random +-1 reward per completion (so advantages and
gradients are non-zero). A random model almost never samples EOS, so completions run to the limit.

Both frameworks take one optimizer step per generation batch (one mini-batch, one epoch; AdamW,
lr 1e-6, no weight decay, grad clip 1.0), fp32, no validation, no checkpoint, no dynamic sampling
(TRL has none; with random rewards it would almost never drop a group). TRL: `loss_type="dapo"`,
`beta=0` (no reference model), epsilon 0.2 / 0.28, no gradient checkpointing (flashdapo's default).

Each (workload, framework) runs in a fresh process, alternating between frameworks over repeats; the
first step of a process is a warm-up and is not timed. Reported per framework (median over steps and
repeats): seconds per step, per-stage seconds, generated tokens per second of generation, the peak
resident set, and the peak beyond the model and optimizer states = peak RSS during the timed steps
minus (RSS after imports + parameter bytes + optimizer-state bytes); gradients, activations, KV
caches, logits and allocator slack count as "beyond".

Both frameworks run under the same thread settings: torch's intra-op threads as flashdapo chooses them
for the model size (flashdapo/threads.py; every CPU for W1 and W2) and OMP_WAIT_POLICY=PASSIVE.

    python -m bench.bench_step [--workloads W1,W2] [--steps N] [--repeats R] [--frameworks flashdapo,trl]
    make bench-step                                  # W1 and W2, table -> bench/results/
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGES = ("gen", "old_log_prob", "update_actor")


@dataclass(frozen=True)
class Workload:
    """A model shape and a generation batch."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    prompts: int
    n: int
    max_new_tokens: int
    steps: int
    """Timed steps per process (after one warm-up step)."""

    @property
    def completions(self) -> int:
        return self.prompts * self.n


WORKLOADS = {
    "W1": Workload(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=32768, prompts=8, n=8,
                   max_new_tokens=8, steps=5),
    # Qwen2.5-0.5B's width, heads, MLP and vocabulary, with 2 of its 24 layers.
    "W2": Workload(hidden=896, layers=2, heads=14, kv_heads=2, intermediate=4864, vocab=151936, prompts=4, n=8,
                   max_new_tokens=128, steps=2),
}


# ------------------------------------------------------------------------------ measuring
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set


def _state_bytes(params, optimizer) -> tuple[int, int]:
    """Bytes of the (local shards of the) parameters and of the optimizer's state tensors."""
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    param = sum(local(p).numel() * local(p).element_size() for p in params)
    opt = sum(local(v).numel() * local(v).element_size() for state in optimizer.state.values()
              for v in state.values() if isinstance(v, torch.Tensor))
    return param, opt


def _summary(step_times, stage_times, gen_tokens, rss0_kb, param_bytes, opt_bytes) -> dict:
    peak = _status_kb("VmHWM") * 1024
    gen = statistics.median(stage_times["gen"])
    return {"s_per_step": statistics.median(step_times),
            **{f"s_{k}": statistics.median(v) for k, v in stage_times.items()},
            "gen_tokens_per_s": statistics.median(gen_tokens) / gen if gen else 0.0,
            "peak_rss_gb": peak / 2**30,
            "beyond_states_gb": (peak - rss0_kb * 1024 - param_bytes - opt_bytes) / 2**30,
            "states_gb": (param_bytes + opt_bytes) / 2**30}


# ------------------------------------------------------------------------------ the workload on disk
def make_workload_dir(w: Workload, root: Path, seed: int = 0) -> Path:
    """Save the random-init model, the toy tokenizer, the prompts (jsonl for flashdapo, text for TRL)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flashdapo.config import DataConfig, ToyTaskConfig
    from flashdapo.tasks import build_datasets
    from flashdapo.tasks.toy import build_toy_tokenizer

    tokenizer = build_toy_tokenizer(ToyTaskConfig())
    config = Qwen2Config(vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.intermediate,
                         num_hidden_layers=w.layers, num_attention_heads=w.heads, num_key_value_heads=w.kv_heads,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).float().save_pretrained(root)
    tokenizer.save_pretrained(root)
    # The toy task's own prompt (DAPO-Math-17k schema: a chat list), ~20 tokens under the toy tokenizer.
    rows = [{"prompt": [{"role": "user", "content": f"Compute {a}+{b}. End with Answer: N"}],
             "reward_model": {"ground_truth": str(a + b)}}
            for a, b in ((i % 9 + 1, (3 * i) % 9 + 1) for i in range(w.prompts))]
    with open(root / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    train, _ = build_datasets(DataConfig(train_files=[str(root / "prompts.jsonl")], shuffle=False), tokenizer)
    texts = [tokenizer.decode(p.ids, skip_special_tokens=False) for p in train.prompts]
    (root / "prompts.json").write_text(json.dumps({"texts": texts, "ids": [p.ids for p in train.prompts]}))
    return root


# ------------------------------------------------------------------------------ flashdapo
class RandomVerifier:
    """+1 or -1 with equal probability, whatever the response (so that every group has a spread)."""

    def __init__(self, seed: int):
        import random

        self.rng = random.Random(seed)

    def __call__(self, response: str, ground_truth: str):
        from flashdapo.reward import Verdict

        good = self.rng.random() < 0.5
        return Verdict(score=1.0 if good else -1.0, acc=good, pred="")


def flashdapo_config(w: Workload, root: Path, run_dir: Path):
    from flashdapo.config import Config, merge

    return merge(Config(), {
        "model": {"path": str(root)},
        "data": {"train_files": [str(root / "prompts.jsonl")], "max_prompt_length": 1024},
        "rollout": {"n": w.n, "max_response_length": w.max_new_tokens, "max_num_seqs": w.completions},
        "algorithm": {"dynamic_sampling": False, "overlong_buffer": False,
                      "overlong_buffer_len": max(w.max_new_tokens // 2, 1)},
        "optim": {"lr": 1e-6, "weight_decay": 0.0, "warmup_steps": 0},
        "trainer": {"total_steps": w.steps + 1, "train_batch": w.prompts, "gen_batch": w.prompts,
                    "mini_batch": w.prompts, "val_every": 0, "val_before_train": False, "device": "cpu"},
        "checkpoint": {"save_every": 0, "export_hf": False},
        "logging": {"run_dir": str(run_dir), "plot": False, "progress": False},
    })


def run_flashdapo(w: Workload, root: Path, seed: int) -> dict:
    from flashdapo.distributed.mesh import shutdown
    from flashdapo.trainer.loop import train_step
    from flashdapo.trainer.setup import setup_run

    rss0 = _status_kb("VmRSS")
    with tempfile.TemporaryDirectory() as run_dir:
        run = setup_run(flashdapo_config(w, root, Path(run_dir)))
        run.verifier = RandomVerifier(seed)
        steps, stages, tokens = [], {k: [] for k in STAGES}, []
        for step in range(1, w.steps + 2):
            start = time.perf_counter()
            m = train_step(run, step)
            elapsed = time.perf_counter() - start
            if step == 1:
                param_bytes, opt_bytes = _state_bytes(run.policy.parameters(), run.optimizer)
                _reset_peak_rss()
                continue
            steps.append(elapsed)
            for k in STAGES:
                stages[k].append(m.get(f"timing_s/{k}", 0.0))
            tokens.append(m["response_length/mean"] * w.completions)
        run.logger.close()
        shutdown()
    return _summary(steps, stages, tokens, rss0, param_bytes, opt_bytes)


# ------------------------------------------------------------------------------ TRL
def run_trl(w: Workload, root: Path, seed: int) -> dict:
    import random

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from flashdapo.tools.threads import configure_threads

    rss0 = _status_kb("VmRSS")
    prompts = json.loads((root / "prompts.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    for text, ids in zip(prompts["texts"], prompts["ids"]):
        assert tokenizer(text, add_special_tokens=False).input_ids == ids, "TRL would see other prompt tokens"
    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32, local_files_only=True)
    configure_threads(sum(p.numel() for p in model.parameters()), torch.device("cpu"))  # as flashdapo's run
    rng = random.Random(seed)

    def random_reward(completions, **_):
        return [rng.choice((1.0, -1.0)) for _ in completions]

    gen_seconds, gen_tokens = [], []
    generate = model.generate

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        gen_seconds.append(time.perf_counter() - start)
        width = (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1]
        gen_tokens.append((out.shape[1] - width) * out.shape[0])
        return out

    model.generate = timed_generate
    clock = _TRLClock(_state_bytes)
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=w.completions, gradient_accumulation_steps=1,
            num_generations=w.n, steps_per_generation=1, num_iterations=1, max_completion_length=w.max_new_tokens,
            loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, temperature=1.0, top_p=1.0,
            learning_rate=1e-6, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
            max_steps=w.steps + 1, logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
            use_cpu=True, bf16=False, gradient_checkpointing=False, seed=seed, disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=random_reward, args=args,
                              train_dataset=Dataset.from_list([{"prompt": t} for t in prompts["texts"]]),
                              processing_class=tokenizer, callbacks=[clock])
        trainer.train()
    steps = clock.seconds[1:]
    gens = gen_seconds[1:len(steps) + 1]
    stages = {"gen": gens, "old_log_prob": [0.0] * len(steps),
              "update_actor": [s - g for s, g in zip(steps, gens)]}
    return _summary(steps, stages, gen_tokens[1:len(steps) + 1], rss0, clock.param_bytes, clock.opt_bytes)


def _TRLClock(state_bytes):
    """A TrainerCallback timing each optimizer step; resets the peak RSS after the warm-up step."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self.param_bytes = self.opt_bytes = 0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.seconds.append(time.perf_counter() - self._start)
            if len(self.seconds) == 1:
                inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
                self.param_bytes, self.opt_bytes = state_bytes(model.parameters(), inner)
                _reset_peak_rss()

    return Clock()


# ------------------------------------------------------------------------------ the table
def _run_child(framework: str, name: str, steps: int, root: Path, seed: int, timeout: int) -> dict:
    spec = json.dumps({"framework": framework, "workload": name, "steps": steps, "root": str(root), "seed": seed})
    # Both frameworks under the same OpenMP settings: flashdapo command line default (flashdapo/threads.py).
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.bench_step", "--child", spec], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout ({timeout}s)"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"status": "ok", **json.loads(line[len("RESULT "):])}
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"status": f"failed: {tail[:160]}"}


def _child(spec: str) -> None:
    s = json.loads(spec)
    w = dataclasses.replace(WORKLOADS[s["workload"]], steps=s["steps"])
    run = run_flashdapo if s["framework"] == "flashdapo" else run_trl
    print("RESULT " + json.dumps(run(w, Path(s["root"]), s["seed"])), flush=True)


def _median_of(results: list[dict]) -> dict:
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        return results[-1]
    return {"status": "ok", **{k: statistics.median(r[k] for r in ok) for k in ok[0] if k != "status"}}


def _row(name: str, framework: str, r: dict, base: dict | None) -> str:
    if r["status"] != "ok":
        return f"| {name} | {framework} | {r['status']} |" + " |" * 9
    speed = f"{base['s_per_step'] / r['s_per_step']:.2f}x" if base and base["status"] == "ok" else ""
    mem = f"{r['beyond_states_gb'] / base['beyond_states_gb']:.2f}" if base and base["status"] == "ok" else ""
    stages = " | ".join(f"{r['s_' + k]:.2f}" for k in STAGES)
    return (f"| {name} | {framework} | {r['s_per_step']:.2f} | {stages} | {r['gen_tokens_per_s']:.0f} | "
            f"{r['peak_rss_gb']:.2f} | {r['beyond_states_gb']:.2f} | {speed} | {mem} |")


def build_table(names: list[str], frameworks: list[str], repeats: int, steps: int | None, timeout: int,
                commit: str) -> str:
    import torch

    from bench.bench_kernels import machine_tag
    from flashdapo.tools.machine import cpu_name

    cpu = cpu_name()
    lines = [f"# Step benchmark: {machine_tag('cpu')}, commit {commit}, {datetime.date.today()}", "",
             f"{cpu}; {os.cpu_count()} CPUs; torch {torch.__version__}; {_trl_version()}; "
             f"load average at start {os.getloadavg()[0]:.1f}", "",
             "Median over timed steps and repeats (runs alternate between frameworks; each in a fresh process). "
             "Stages in seconds; TRL's generation is timed around `model.generate`, its update is the rest "
             "of the step. *beyond* = peak RSS minus (RSS after imports + parameters + optimizer states). "
             "speedup = TRL s/step / this row's; memory = this row's beyond / TRL's.", ""]
    for name in names:
        w = dataclasses.replace(WORKLOADS[name], steps=steps or WORKLOADS[name].steps)
        lines += [f"## {name}: {asdict(w)}, repeats {repeats}", "",
                  "| workload | framework | s/step | gen | old log-prob | update | gen tok/s | peak RSS GB "
                  "| beyond GB | speedup vs TRL | memory vs TRL |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        results: dict[str, list[dict]] = {f: [] for f in frameworks}
        with tempfile.TemporaryDirectory() as tmp:
            root = make_workload_dir(w, Path(tmp))
            for rep in range(repeats):
                for f in frameworks:
                    results[f].append(_run_child(f, name, w.steps, root, seed=rep, timeout=timeout))
                    print(f"{name} {f} repeat {rep}: {results[f][-1]}", file=sys.stderr, flush=True)
        med = {f: _median_of(rs) for f, rs in results.items()}
        base = med.get("trl")
        lines += [_row(name, f, med[f], base if f != "trl" else None) for f in frameworks] + [""]
    return "\n".join(lines)


def _trl_version() -> str:
    try:
        import trl
    except ImportError:
        return "trl not installed (pip install -e '.[bench]')"
    return f"trl {trl.__version__}"


def main(argv=None) -> int:
    from bench.bench_kernels import git_commit, write_result

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="W1,W2", help=f"comma-separated, of {sorted(WORKLOADS)}")
    parser.add_argument("--frameworks", default=None, help="flashdapo,trl (default: trl when importable)")
    parser.add_argument("--repeats", type=int, default=1, help="processes per framework and workload")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per process (default: the workload's)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per process")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; choose from {sorted(WORKLOADS)}")
    frameworks = args.frameworks.split(",") if args.frameworks else ["flashdapo"] + (
        ["trl"] if "not installed" not in _trl_version() else [])
    commit = git_commit()
    table = build_table(names, frameworks, args.repeats, args.steps, args.timeout, commit)
    write_result(table, args.out, commit, f"step-{'-'.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Long-tail generation benchmark: rounds vs streaming dynamic sampling, with and without partial rollouts.

The workload is the `longtail` preset (flashdapo/config/presets.py): the toy arithmetic task whose warm-up
answers open with a lognormal number of filler tokens, so the warmed-up model's response lengths are
heavy-tailed. The base model is warmed up once (OUT/base, reused while its settings match) and every run
trains from it on the task's problems written as data files, as `flashdapo ablate` does.

Three arms, the same config otherwise:

- `rounds`: rollout.streaming false. Rounds of gen_batch prompts, each waiting for its longest response.
- `stream`: streaming, stop at train_batch kept groups, partial_rollouts false (aborted groups are dropped).
- `carry`: streaming, stop at the target, partial_rollouts true (aborted responses finish next step).

Each run is a plain `flashdapo train` process (torchrun, gloo, for several ranks) of --steps steps, without
validation. Per run: s/step = the mean of `timing_s/step` over steps 2.. (step 1 has nothing carried in),
generated tokens per trained token (`train/generated_tokens` over the trained responses' tokens), the mean
trained-response length over all steps (`response_length/mean`), trained groups per step
(`train/kept_groups`). The machine is noisy: the arms of one repeat run one after another in an order that
rotates between repeats, every arm of a repeat uses the same seed (trainer.seed = repeat), and the table
gives each figure's median over repeats with its range, and its ratio to the same repeat's rounds run.

    python -m bench.bench_longtail [--ranks 1,2] [--repeats 3] [--steps 10] [--arms rounds,stream,carry]
    python -m bench.bench_longtail --smoke          # seconds: a tiny model, 2 steps, 1 rank, in this process
    make bench-longtail                             # table -> bench/results/<date>-<machine>-<commit>-longtail.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARMS = {
    "rounds": {"rollout": {"streaming": False}},
    "stream": {"rollout": {"streaming": True, "partial_rollouts": False}},
    "carry": {"rollout": {"streaming": True, "partial_rollouts": True}},
    "carry4": {"rollout": {"streaming": True, "partial_rollouts": True, "max_carry_steps": 4}},
}
"""Each arm's fields on top of the workload. carry4: a carried response restarts from scratch only once its
oldest token is over 4 policy versions old (the default, 1, restarts the longest responses: a length bias)."""
COMMON = {"trainer": {"val_every": 0, "val_before_train": False},
          "checkpoint": {"save_every": 0, "export_hf": False, "keep_last": 1},
          "logging": {"plot": False}}
"""No validation, plot or export: the runs time training steps."""
SMOKE = {
    "model": {"toy": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                      "intermediate_size": 64, "sft_steps": 30, "sft_batch": 16}},
    "data": {"toy": {"num_train": 64, "num_val": 0, "filler_median": 2.0}},
    "rollout": {"n": 4, "max_response_length": 24, "max_num_seqs": 64},
    # The briefly warmed-up model is rarely right: its groups differ by the overlong penalty instead.
    "algorithm": {"overlong_buffer_len": 16, "filter_metric": "score"},
    "trainer": {"total_steps": 2, "train_batch": 4, "gen_batch": 8, "mini_batch": 2},
}
"""--smoke: a tiny model briefly warmed up, short responses, two steps."""
VLLM = {"model": {"toy": {"num_heads": 2}}, "rollout": {"kv_cache_gib": 0.5}}
"""--engine vllm: head size 32 (vLLM's CPU attention has no 16), a KV cache of 0.5 GiB (the toy's 384 rows
of ~200 tokens need ~75 MiB in fp32): a model of its own, so its arms compare with its own rounds."""
FROZEN_LR = 1e-12
"""--frozen: a learning rate whose AdamW steps (~lr per weight) are far below the fp32 spacing of the weights."""


@dataclass(frozen=True)
class ArmResult:
    """What one run measured."""

    s_per_step: float
    gen_s_per_step: float
    generated_per_trained: float
    mean_length: float
    samples_per_step: float
    """Trained groups per step."""
    carried_per_step: float
    dropped_per_step: float
    lag_mean: float
    wait_s: float
    """Mean `timing_s/wait_after_target` over steps 2..: the stream's time past its target."""
    load: float
    """The 1-minute load average when the run started."""


def workload(smoke: bool, engine: str = "torch"):
    """The longtail preset with the bench's settings (the smoke shape, the vLLM shape), torch engine: the
    built-in toy model has no path for vLLM to load until `prepare` saves it."""
    from flashdapo.config import merge, preset

    cfg = merge(preset("longtail"), COMMON)
    cfg = merge(cfg, SMOKE) if smoke else cfg
    return merge(cfg, VLLM) if engine == "vllm" else cfg


def prepare(cfg, work: Path, log=print):
    """Warm the base model up once (reused while its settings match) and write the task's data files; the
    config every arm starts from."""
    from flashdapo.ablation.base import build_base, write_task_files
    from flashdapo.config import merge

    build_base(cfg, work / "base", log)
    train_file, _ = write_task_files(cfg, work / "data")
    return merge(cfg, {"model": {"path": str((work / "base").resolve())},
                       "data": {"train_files": [str(train_file.resolve())], "val_files": []}})


def run_arm(cfg, ranks: int, in_process: bool, timeout: int, preset: str = "longtail", flags: tuple[str, ...] = (),
            env: dict[str, str] | None = None, bench: str = "bench_longtail") -> list[dict]:
    """One `flashdapo train` run (fresh run directory); its metrics.jsonl records. `flags` follow the config
    on the command line (they need a subprocess) and `env` joins the subprocess's environment."""
    from flashdapo.trainer.observe.sinks import read_history

    run_dir = Path(cfg.logging.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    if in_process and ranks == 1 and not flags:
        from flashdapo.trainer.loop import train

        train(cfg)
    else:
        config = run_dir.parent / f"{run_dir.name}.yaml"
        config.write_text(cfg.to_yaml())
        launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                  if ranks > 1 else [sys.executable])
        env = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([*launch, "-m", "flashdapo", "train", "--preset", preset, "--config", str(config), *flags],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{bench}: {run_dir.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [r for r in read_history(run_dir / "metrics.jsonl") if r.get("step", 0) >= 1]


def summarize(history: list[dict], n: int, load: float = 0.0) -> ArmResult:
    """A run's figures from its step records (see the module docstring)."""
    timed = history[1:] or history
    trained = sum(r["response_length/mean"] * r["train/kept_groups"] * n for r in history)
    steps = len(history)
    return ArmResult(
        s_per_step=statistics.fmean(r["timing_s/step"] for r in timed),
        gen_s_per_step=statistics.fmean(r["timing_s/gen"] for r in timed),
        generated_per_trained=sum(r["train/generated_tokens"] for r in history) / max(trained, 1.0),
        mean_length=statistics.fmean(r["response_length/mean"] for r in history),
        samples_per_step=statistics.fmean(r["train/kept_groups"] for r in history),
        carried_per_step=sum(r.get("stream/carried", 0.0) for r in history) / steps,
        dropped_per_step=sum(r.get("stream/dropped_groups", 0.0) for r in history) / steps,
        lag_mean=statistics.fmean(r.get("stream/lag_mean", 0.0) for r in history),
        wait_s=statistics.fmean(r.get("timing_s/wait_after_target", 0.0) for r in timed), load=load)


def engine_streams(engine: str) -> bool:
    """Whether the rollout engine implements the streaming contract (open_stream)."""
    if engine == "torch":
        return True
    from flashdapo.rollout.vllm_engine import VLLMEngine

    return hasattr(VLLMEngine, "open_stream")


def run_all(base, ranks: list[int], arms: list[str], repeats: int, work: Path, in_process: bool, timeout: int,
            log=print) -> dict[tuple[int, str], list[ArmResult]]:
    """Every (ranks, arm) run of every repeat, interleaved: within a repeat the arms' order rotates."""
    from flashdapo.config import merge

    results: dict[tuple[int, str], list[ArmResult]] = {(w, a): [] for w in ranks for a in arms}
    for rep in range(repeats):
        for w in ranks:
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]
            for arm in order:
                cfg = merge(base, ARMS[arm])
                cfg = merge(cfg, {"trainer": {"seed": rep},
                                  "logging": {"run_dir": str(work / "runs" / f"{arm}-w{w}-r{rep}")}})
                load = os.getloadavg()[0]
                result = summarize(run_arm(cfg, w, in_process, timeout), cfg.rollout.n, load)
                results[(w, arm)].append(result)
                log(f"bench_longtail: repeat {rep} ranks {w} {arm}: {result.s_per_step:.2f} s/step, "
                    f"gen {result.gen_s_per_step:.2f} s, {result.samples_per_step:.1f} groups, "
                    f"length {result.mean_length:.2f}, generated/trained {result.generated_per_trained:.2f}, "
                    f"load {load:.1f}")
    return results


def _spread(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def _ratios(mine: list[ArmResult], rounds: list[ArmResult] | None, name: str) -> list[float]:
    return [getattr(a, name) / getattr(b, name) for a, b in zip(mine, rounds or [])
            if getattr(b, name)]


def table(results: dict[tuple[int, str], list[ArmResult]], ranks: list[int], arms: list[str]) -> list[str]:
    """The markdown table: per (ranks, arm) medians [min, max] over repeats, and paired ratios to rounds."""
    lines = ["| ranks | arm | s/step | gen s/step | s/step / rounds | generated / trained tokens | ratio | "
             "mean trained length | ratio | trained groups / step | ratio | carried / step | dropped groups / step "
             "| token lag | wait after target s/step |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in ranks:
        rounds = results.get((w, "rounds"))
        for arm in arms:
            rs = results[(w, arm)]
            cells = [str(w), arm, _spread([r.s_per_step for r in rs], ".2f"), _spread([r.gen_s_per_step for r in rs], ".2f")]
            cells.append(_spread(_ratios(rs, rounds, "s_per_step"), ".3f") if rounds else "")
            for name, fmt in (("generated_per_trained", ".2f"), ("mean_length", ".2f"), ("samples_per_step", ".1f")):
                cells += [_spread([getattr(r, name) for r in rs], fmt),
                          _spread(_ratios(rs, rounds, name), ".3f") if rounds else ""]
            cells += [_spread([r.carried_per_step for r in rs], ".1f"), _spread([r.dropped_per_step for r in rs], ".1f"),
                      _spread([r.lag_mean for r in rs], ".3f"), _spread([r.wait_s for r in rs], ".2f")]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(results, ranks: list[int], arms: list[str], cfg, args, commit: str) -> str:
    """The results file: machine, commit, workload, table."""
    import torch

    from bench.bench_kernels import machine_tag
    from flashdapo.tools.machine import cpu_name

    cpu = cpu_name()
    tc, rc = cfg.trainer, cfg.rollout
    loads = sorted(r.load for rs in results.values() for r in rs)
    return "\n".join([
        f"# Long-tail streaming benchmark: {machine_tag('cpu')}, commit {commit}, {datetime.date.today()}", "",
        f"{cpu}; {os.cpu_count()} CPUs, shared; torch {torch.__version__}; engine {rc.engine}; 1-minute load "
        f"average at the runs' starts {statistics.median(loads):.1f} [{loads[0]:.1f}, {loads[-1]:.1f}], at the end "
        f"{os.getloadavg()[0]:.1f}. `{' '.join(['python -m bench.bench_longtail', *sys.argv[1:]])}`", "",
        f"Workload: preset `longtail` (filler median {cfg.data.toy.filler_median:g}, sigma "
        f"{cfg.data.toy.filler_sigma:g}), n {rc.n}, max_response_length {rc.max_response_length}, "
        f"train_batch {tc.train_batch}, gen_batch {tc.gen_batch} (= max_in_flight), max_num_seqs {rc.max_num_seqs}, "
        f"agree_every {rc.agree_every}"
        + (f", toy num_heads {cfg.model.toy.num_heads} (head size 32 for vLLM's CPU attention), kv_cache_gib "
           f"{rc.kv_cache_gib:g}" if rc.engine == "vllm" else "") + "; "
        f"{args.steps} steps per run, {args.repeats} repeats, seed = repeat"
        + (f"; **frozen policy** (optim.lr {FROZEN_LR:g}, updates below the weights' fp32 resolution: every run "
           "samples the base model, so the trained-length ratios measure the collection's length bias alone)."
           if args.frozen else f"; optim.lr {cfg.optim.lr:g}."), "",
        "Measured. Each cell: median over repeats [min, max]; ratios are to the same repeat's `rounds` run. "
        "s/step: mean `timing_s/step` over steps 2.. of a run; mean trained length: `response_length/mean` over "
        "every step; token lag: mean policy versions between a trained token's sampling and the update; wait "
        "after target: mean `timing_s/wait_after_target` over steps 2.. (the engine steps run until the ranks' "
        "next agreement, and the abort).", "",
        *table(results, ranks, arms), ""])


def main(argv=None) -> int:
    from bench.bench_kernels import git_commit, write_result

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2", help="comma-separated world sizes (torchrun, gloo)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="training steps per run")
    parser.add_argument("--engine", choices=("torch", "vllm"), default="torch")
    parser.add_argument("--frozen", action="store_true",
                        help="optim.lr 1e-12 (updates below the weights' fp32 resolution): the runs keep sampling "
                             "the base model, so the trained-length ratios measure the collection's length bias "
                             "alone, without the runs' diverging training")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 2 steps, 1 rank, in this process")
    parser.add_argument("--work", default=str(REPO / "runs" / "bench-longtail"), help="base model and runs")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    args = parser.parse_args(argv)
    if not engine_streams(args.engine):
        print(f"bench_longtail: the {args.engine} engine has no streaming methods (open_stream) yet; nothing run")
        return 1
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := sorted(set(arms) - set(ARMS)):
        parser.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    ranks = [1] if args.smoke else [int(w) for w in args.ranks.split(",")]
    if args.smoke:
        args.steps, args.repeats = 2, 1
    from flashdapo.config import merge

    commit = git_commit()  # of the code that runs (edits made while it runs do not count)
    work = Path(args.work)
    cfg = merge(workload(args.smoke, args.engine), {"trainer": {"total_steps": args.steps}})
    cfg = merge(cfg, {"optim": {"lr": FROZEN_LR}}) if args.frozen else cfg
    base = merge(prepare(cfg, work), {"rollout": {"engine": args.engine}})
    results = run_all(base, ranks, arms, args.repeats, work, in_process=args.smoke, timeout=args.timeout)
    text = report(results, ranks, arms, base, args, commit)
    write_result(text, args.out, commit, "longtail" + "-frozen" * args.frozen + "-smoke" * args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Metrics: sinks (metrics.jsonl, console line, TensorBoard, W&B), the dynamics plot.

Metric names follow verl (docs/algorithm.md, section 8) so users can compare curves. Only rank 0 writes.
A failed write of metrics.jsonl or the plot (a full disk, a file size limit) never stops training: it warns
once per file and goes on; metrics.jsonl is rewritten whole from memory at the next write that succeeds, so it
has no gap once the disk has room again.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import FlashdapoError

REQUIRED_KEYS = (
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/advantages/max",
    "critic/advantages/min",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "response_length/clip_ratio",
    "prompt_length/mean",
    "prompt_length/max",
    "actor/pg_loss",
    "actor/entropy",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/lr",
    "actor/token_prob",
    "actor/skipped_steps",
    "train/num_gen_batches",
    "train/kept_fraction",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/step",
    "perf/throughput",
    "perf/max_memory_allocated_gb",
)


def _kept(m: dict) -> str:
    """The kept fraction, or '-' for a split-placement batch of rolled-over groups (nothing generated)."""
    return f"{m['train/kept_fraction']:.2f}" if "train/kept_fraction" in m else "-"


def describe(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """mean / max / min of a tensor under `prefix/` (0 for an empty tensor)."""
    v = values.double()
    if v.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {
        f"{prefix}/mean": v.mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()
    }


class MetricsError(FlashdapoError, ValueError):
    """metrics.jsonl cannot be read back (not the torn last line of a crash, which is dropped)."""


def read_history(path: Path) -> list[dict]:
    """The records of a metrics.jsonl. A torn last line (a crash mid-write) is dropped with a warning;
    any other unreadable line is an error naming the file and line."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    history = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                print(
                    f"flashdapo: warning: {path}: dropping the torn last line {number} (a crash mid-write): "
                    f"{line[:60]!r}", flush=True)
                break
            raise MetricsError(f"{path}: line {number} is not JSON ({err.msg}); repair or remove it") from err
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            raise MetricsError(
                f"{path}: line {number} is not a metrics record with a step; repair or remove it")
        history.append(record)
    return history


class MetricsLogger:
    """Writes one JSON object per step to metrics.jsonl and to the optional sinks; prints a line."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, wandb: bool, wandb_project: str,
                 progress: bool, total_steps: int, config_dict: dict, wandb_run: WandbRun | None = None):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.progress = progress and enabled
        self.total_steps = total_steps
        self.history: list[dict] = []
        self._unwritten: set[Path] = set()
        """Files whose last write failed (warned once; metrics.jsonl is then rewritten whole)."""
        self._tb = self._wandb = None
        if not enabled:
            return
        if self.path.exists():
            self.history = read_history(self.path)
        if tensorboard:
            self._tb = _optional_tensorboard(run_dir)
        if wandb:
            self._wandb = _start_wandb(wandb_run or WandbRun(wandb_project), run_dir, config_dict)

    def truncate_after(self, step: int) -> int:
        """Forget steps after `step` (resume from a checkpoint taken at `step`); returns how many records
        went."""
        if not self.enabled:
            return 0
        kept = [m for m in self.history if m["step"] <= step]
        dropped, self.history = len(self.history) - len(kept), kept
        self.path.write_text("".join(json.dumps(m) + "\n" for m in self.history))
        return dropped

    def log(self, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                 for k, v in metrics.items()}
        self.history.append(clean)
        self._write_records(clean)
        step = int(clean["step"])
        if self._tb is not None:
            for k, v in clean.items():
                if k != "step" and isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self.progress:
            print(format_line(clean, self.total_steps), flush=True)

    def _write_records(self, record: dict) -> None:
        """Append `record` to metrics.jsonl; after a failed write, rewrite the whole file (tmp + rename)."""
        try:
            if self.path in self._unwritten:
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(json.dumps(m) + "\n" for m in self.history))
                tmp.replace(self.path)
            else:
                with self.path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                    f.flush()
        except OSError as err:
            self._failed(self.path, err)
            return
        self._unwritten.discard(self.path)

    def plot(self, path: Path, title: str) -> None:
        """Write the dynamics plot of the history so far; a failure warns once and training goes on."""
        try:
            plot_dynamics(self.history, path, title)
        except Exception as err:  # any failure of a plot (disk, backend): never worth the run
            self._failed(path, err)
            return
        self._unwritten.discard(path)

    def _failed(self, path: Path, err: BaseException) -> None:
        if path not in self._unwritten:
            print(
                f"flashdapo: warning: cannot write {path} ({type(err).__name__}: {err}); training goes on, "
                "and "
                "the file is written again at its next update", flush=True)
        self._unwritten.add(path)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def format_line(m: dict, total_steps: int) -> str:
    """The one line per step: progress, learning signals, speed, and time per stage. A step that kept no group
    or took no optimizer step says so instead of showing zeros."""
    if "train/num_gen_batches" not in m:  # a validation-only record (before training)
        return f"step {int(m['step']):>4}/{total_steps} | " + _val_part(m)
    stages = " ".join(f"{k.split('/')[1]} {v:.1f}" for k, v in m.items()
                      if k.startswith("timing_s/") and k != "timing_s/step")
    acc = f"acc {m.get('train/gen_acc', float('nan')):.3f}"
    learned = (f"score {m['critic/score/mean']:+.3f} {acc} | " if "critic/score/mean" in m else
               f"no group kept, {acc} | ")
    if "actor/entropy" in m:
        learned += f"ent {m['actor/entropy']:.3f} "
    elif m.get("actor/skipped_steps"):
        learned += "no update (non-finite) "
    else:
        learned += "no update "
    if "response_length/mean" in m:
        learned += f"len {m['response_length/mean']:.1f} clip {m['response_length/clip_ratio']:.2f} "
    if m.get("actor/skipped_steps"):
        learned += f"skipped {int(m['actor/skipped_steps'])} "
    line = (
        f"step {int(m['step']):>4}/{total_steps} | {learned}| "
        f"kept {_kept(m)} rounds {int(m['train/num_gen_batches'])} | "
        f"{m['perf/throughput']:.0f} tok/s | {m['timing_s/step']:.1f}s ({stages})"
    )
    val = _val_part(m)
    return line + (" | " + val if val else "")


def _val_part(m: dict) -> str:
    """Pooled mean@k / pass@k / maj@k, then each data source's mean@k (every key is in metrics.jsonl)."""
    pooled = [f"val/acc/{name}@k" for name in ("mean", "pass", "maj")]
    per_source = sorted(k for k in m
                        if k.startswith("val/") and k.endswith("/acc/mean@k") and k not in pooled)
    return " ".join(f"{k[4:]} {m[k]:.3f}" for k in pooled + per_source if k in m)


def _optional_tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("flashdapo: logging.tensorboard=true but tensorboard is not installed; skipping it")
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


@dataclass(frozen=True)
class WandbRun:
    """Where and how a run logs to W&B (the logging.wandb_* fields)."""

    project: str
    entity: str = ""
    """'' : wandb's default entity."""
    name: str = ""
    """'' : the run directory's name."""
    tags: tuple[str, ...] = ()
    mode: str = "online"

    @classmethod
    def from_config(cls, logging_cfg) -> WandbRun:
        lc = logging_cfg
        return cls(lc.wandb_project, lc.wandb_entity, lc.wandb_run_name, tuple(lc.wandb_tags), lc.wandb_mode)


def _start_wandb(settings: WandbRun, run_dir: Path, config_dict: dict):
    try:
        import wandb
    except ImportError as err:  # preflight.check_launch refuses this before the run starts
        raise MetricsError(
            "logging.wandb: true needs the wandb package (pip install wandb); or set it false") from err
    return wandb.init(project=settings.project, entity=settings.entity or None, name=settings.name or
                      run_dir.name, tags=list(settings.tags) or None, mode=settings.mode, dir=str(run_dir),
                      config=config_dict)


PLOT_PANELS = (
    ("reward", ["critic/score/mean"]),
    ("accuracy", ["train/gen_acc", "val/acc/mean@k"]),
    ("response length", ["response_length/mean"]),
    ("entropy", ["actor/entropy", "probe/entropy"]),
    ("clip fraction", ["actor/pg_clipfrac", "actor/clipfrac_upper", "actor/pg_clipfrac_lower",
                       "response_length/clip_ratio"]),
    ("dynamic sampling", ["train/kept_fraction"]),
    ("mean token probability", ["actor/token_prob"]),
    ("gen rounds", ["train/num_gen_batches"]),
)


def plot_dynamics(history: list[dict], path: Path, title: str) -> None:
    """The training dynamics of the paper's Fig. 7, one panel per quantity, over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, (name, keys) in zip(axes.flat, PLOT_PANELS):
        for key in keys:
            points = [(m["step"], m[key]) for m in history if key in m]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if key.startswith("val/") else None, markersize=3,
                        label=key.split("/", 1)[1] if "/" in key else key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    try:
        fig.savefig(tmp, dpi=90)
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)  # after a failed write (a full disk)

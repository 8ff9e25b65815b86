"""The ladder's base model: the built-in task's warm-up, run once and saved as an HF directory that every
arm starts from (`model.path`), and what that base does on the task before any RL.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import Config, RolloutConfig
from ..eval.sampling import EvalSampling, sample_prompts
from ..models.hf import resolved_attention
from ..models.policy import PolicyModel
from ..reward import get_verifier
from ..rollout import RolloutEngine
from ..rollout.factory import build_engine, cpu_env
from ..tasks import build_datasets, build_task_tokenizer, task_records
from ..tasks.toy import build_toy_model
from ..tasks.warmup import warm_up_built_in
from ..tools.machine import machine_summary
from ..tools.threads import configure_threads

BASE_MARKER = "base.json"
"""Written last into the base directory: the warm-up settings it was built with (a rerun reuses the base
only when they match)."""


def base_settings(cfg: Config) -> dict:
    """What the base model depends on: the task, the model shape and warm-up, and the warm-up's seed."""
    return {"data": {"task": cfg.data.task, cfg.data.task: asdict(getattr(cfg.data, cfg.data.task)),
                     "max_prompt_length": cfg.data.max_prompt_length},
            "model": asdict(cfg.model.toy), "max_response_length": cfg.rollout.max_response_length,
            "seed": cfg.trainer.seed}


def write_task_files(cfg: Config, out: Path) -> tuple[Path, Path]:
    """The built-in task's train and validation problems as DAPO-schema jsonl files under `out` (train.jsonl,
    val.jsonl): every arm trains from a model directory on data files, as any user run does, and its
    config.yaml reruns it alone. Deterministic in cfg.data, so rewriting them keeps their content hashes."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split in ("train", "val"):
        rows = [{"data_source": f"{cfg.data.task}_{split}", "prompt": r.messages,
                 "reward_model": {"ground_truth": r.ground_truth, "style": "rule"}}
                for r in task_records(cfg.data, split)]
        path = out / f"{split}.jsonl"
        text = "".join(json.dumps(row) + "\n" for row in rows)
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
        paths.append(path)
    return paths[0], paths[1]


def build_base(cfg: Config, out: Path, log: Callable[[str], None] = print) -> bool:
    """Warm the built-in model up on cfg's task and save it (model and tokenizer) to `out`; reuse `out` when
    it already holds a base built with the same settings. Returns True when it trained one."""
    settings = base_settings(cfg)
    marker = out / BASE_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == settings:
        log(f"base model: reusing {out}")
        return False
    tokenizer = build_task_tokenizer(cfg.data)
    max_positions = cfg.data.max_prompt_length + cfg.rollout.max_response_length + 8
    hf_model = build_toy_model(cfg.model, len(tokenizer), max_positions, cfg.trainer.seed)
    configure_threads(sum(p.numel() for p in hf_model.parameters()), torch.device("cpu"))
    policy = PolicyModel(hf_model, resolved_attention(cfg.model.attn_implementation, None),
                         cfg.trainer.kernel_impl, cfg.rollout.temperature)
    warm_up_built_in(policy, cfg, tokenizer, log=log)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / BASE_MARKER).write_text(json.dumps(settings, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    log(f"base model: {sum(p.numel() for p in hf_model.parameters()):,} parameters, saved to {out}")
    return True


def weights_digest(model_dir: Path) -> str:
    """The first 12 hex digits of the sha256 of the model's weight files (*.safetensors, in name order): what
    a base's directory name (a hash of its settings) cannot say, whether two machines built the same model."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def provenance(model_paths: Iterable[str]) -> str:
    """One report line: each distinct base model among the runs' `model.path`s (empty ones skipped), by its
    weights digest, and the machine, with why both matter."""
    base_dirs = [Path(p) for p in dict.fromkeys(p for p in model_paths if p)]
    bases = ", ".join(f"`{d.name}` (weights sha256 {weights_digest(d)})" for d in base_dirs)
    return (
        f"Base model(s): {bases}. Machine: {machine_summary()}. The warm-up is deterministic on one machine, "
        "but another CPU's floating-point kernels give another base (another digest) and other numbers.")


@dataclass(frozen=True)
class BaseStatistics:
    """How the base model samples the training prompts at the training settings (n responses each)."""

    prompts: int
    n: int
    accuracy: float
    truncated: float
    """Fraction of responses that hit rollout.max_response_length."""
    all_right: float
    """Fraction of groups whose n responses are all right."""
    all_wrong: float
    """Fraction of groups whose n responses are all wrong."""
    rare_right: float
    """Fraction of groups with exactly one right response (a right answer the policy finds rarely)."""
    mean_length: float

    def summary(self) -> str:
        return (
            f"{self.prompts} prompts x {self.n}: accuracy {self.accuracy:.3f}, truncated "
            f"{self.truncated:.3f}, "
            f"groups all right {self.all_right:.3f} / all wrong {self.all_wrong:.3f} / one right "
            f"{self.rare_right:.3f}, mean length {self.mean_length:.1f} tokens")


def cpu_engine(model_dir: Path, max_batch: int) -> tuple[Any, RolloutEngine]:
    """The tokenizer and a CPU torch engine over the HF model saved in `model_dir` (a base or a run's
    export)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return tokenizer, build_engine(RolloutConfig(engine="torch", max_num_seqs=max_batch), cpu_env(),
                                   tokenizer, model=model)


def base_statistics(cfg: Config, base_dir: Path, prompts: int = 64, seed: int = 0) -> BaseStatistics:
    """Sample the first `prompts` training prompts of cfg's task with the base in `base_dir`, rollout.n
    responses each at the training temperature and top_p, and count truncation and all-equal groups."""
    tokenizer, engine = cpu_engine(base_dir, cfg.rollout.max_num_seqs)
    train, _ = build_datasets(cfg.data, tokenizer)
    rc = cfg.rollout
    sampling = EvalSampling(k=rc.n, temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                            max_new_tokens=rc.max_response_length, seed=seed, prompts_per_call=prompts)
    results = sample_prompts(engine,
                             list(train.prompts)[:prompts], tokenizer, get_verifier(cfg.algorithm.verifier),
                             sampling)
    right = [sum(s.acc for s in r.samples) for r in results]
    samples = [s for r in results for s in r.samples]
    return BaseStatistics(prompts=len(results), n=rc.n, accuracy=sum(right) / len(samples),
                          truncated=sum(s.finish_reason == "length" for s in samples) / len(samples),
                          all_right=sum(c == rc.n for c in right) / len(results),
                          all_wrong=sum(c == 0 for c in right) / len(results),
                          rare_right=sum(c == 1 for c in right) / len(results),
                          mean_length=sum(s.length for s in samples) / len(samples))

"""A panel run's final evaluation: its exported policy on every validation problem, k samples each at top_p
1.0 and at the validation's top_p (0.7, as DAPO evaluates: where the right token is a minority, top_p 0.7 can
cut it), written to RUN_DIR/final_eval.json and reused while the run and k are the same."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import Config
from ..eval.sampling import EvalSampling, sample_prompts
from ..reward import get_verifier
from ..tasks import build_datasets
from .base import cpu_engine

FINAL_EVAL = "final_eval.json"
FINAL_EVAL_SEED = 12345
"""Sampling seed of every final evaluation (the same for both arms of a pair, and for every seed)."""


@dataclass(frozen=True)
class FinalScore:
    """mean@k and pass@k over the validation problems at one top_p."""

    top_p: float
    k: int
    problems: int
    mean: float
    pass_at_k: float


def final_top_ps(cfg: Config) -> tuple[float, ...]:
    """top_p 1.0 and the validation's top_p (once when they are equal)."""
    return tuple(dict.fromkeys((1.0, cfg.rollout.val_top_p)))


def final_evaluation(cfg: Config, k: int) -> list[FinalScore]:
    """Evaluate RUN_DIR/export (or reuse final_eval.json written for the same config and k)."""
    run_dir = Path(cfg.logging.run_dir)
    path = run_dir / FINAL_EVAL
    key = {"config": cfg.to_dict(), "k": k, "seed": FINAL_EVAL_SEED}
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return [FinalScore(**s) for s in saved["scores"]]
    scores = [_score(cfg, run_dir / "export", k, top_p) for top_p in final_top_ps(cfg)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "scores": [asdict(s) for s in scores]}, indent=1))
    tmp.replace(path)
    return scores


def read_final_evaluation(run_dir: Path) -> list[FinalScore]:
    """The scores in RUN_DIR/final_eval.json ([] when there is none)."""
    path = run_dir / FINAL_EVAL
    return [FinalScore(**s) for s in json.loads(path.read_text())["scores"]] if path.is_file() else []


def _score(cfg: Config, model_dir: Path, k: int, top_p: float) -> FinalScore:
    tokenizer, engine = cpu_engine(model_dir, cfg.rollout.max_num_seqs)
    _, val = build_datasets(cfg.data, tokenizer)
    rc = cfg.rollout
    prompts = list(val.prompts)
    sampling = EvalSampling(k=k, temperature=rc.val_temperature, top_p=top_p, top_k=rc.top_k,
                            max_new_tokens=rc.max_response_length, seed=FINAL_EVAL_SEED,
                            prompts_per_call=len(prompts))
    results = sample_prompts(engine, prompts, tokenizer, get_verifier(cfg.algorithm.verifier), sampling)
    right = [sum(s.acc for s in r.samples) for r in results]
    return FinalScore(top_p=top_p, k=k, problems=len(results), mean=sum(right) / (k * len(results)),
                      pass_at_k=sum(c > 0 for c in right) / len(results))

"""`flashdapo eval`: evaluate a saved model (HF directory) on a parquet/jsonl file, as DAPO reports it.

Its options are fields of the config tree: each takes its type, checks, help and default from the field
it stands for (`--k` is `rollout.val_n`), starting from the tree's defaults (the paper's evaluation
settings), or from `--preset NAME` / `--config FILE` (e.g. a run's config.yaml). Every option is
checked before the model is loaded.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from pathlib import Path
from typing import Annotated, Any

import torch

from .config import Config, ConfigError, starting_point
from .config.checks import Check, Rule, Section, field_docs, field_path, field_spec, register_tree
from .evaluate import EvalResult, evaluate

OPTIONS = {
    "k": "rollout.val_n",
    "temperature": "rollout.val_temperature",
    "top_p": "rollout.val_top_p",
    "max_new_tokens": "rollout.max_response_length",
    "max_prompt_length": "data.max_prompt_length",
    "batch_size": "rollout.max_num_seqs",
    "verifier": "algorithm.verifier",
    "device": "trainer.device",
    "seed": "trainer.seed",
}
"""Each option of `flashdapo eval` and the config field it stands for."""


def _is_file(path: str) -> bool:
    return path.endswith((".parquet", ".jsonl")) and Path(path).is_file()


def eval_args_class(base: Config) -> type:
    """The dataclass tyro parses `flashdapo eval` into: --model, --data, then the OPTIONS with `base`'s values
    as defaults. Building it checks every option (types and ranges of the tree, files, CUDA)."""
    import tyro

    fields: list[tuple[str, Any, Any]] = [
        ("model", Annotated[str, Check(lambda p: Path(p).is_dir(), "an existing directory"),
                            tyro.conf.arg(help="Local HF model directory (e.g. a run's export/ folder).")], ...),
        ("data", Annotated[str, Check(_is_file, "an existing .parquet or .jsonl file"),
                           tyro.conf.arg(help="Evaluation file, e.g. aime-2024.parquet.")], ...),
    ]
    for name, path in OPTIONS.items():
        section_path, _, leaf = path.rpartition(".")
        section = operator.attrgetter(section_path)(base)
        tp, checks = field_spec(type(section), leaf)
        help_text = " ".join(field_docs(type(section))[leaf].split()) + f" (config field {path})"
        fields.append((name, Annotated[(tp, *checks, tyro.conf.arg(help=help_text))],
                       dataclasses.field(default=getattr(section, leaf))))
    fields = [(n, t) if d is ... else (n, t, d) for n, t, d in fields]
    cls = dataclasses.make_dataclass("EvalArgs", fields, bases=(Section,))
    cls.__doc__ = "Evaluate a saved model (HF directory) on a parquet/jsonl in the DAPO / AIME-2024 schema."
    cls.RULES = (Rule("device", lambda a: a.device != "cuda" or torch.cuda.is_available(),
                      lambda a: "'auto' or 'cpu' (CUDA is not available)"),)
    register_tree(cls, "eval.")
    return cls


def eval_main(argv: list[str]) -> EvalResult:
    """`flashdapo eval`: check the options, load, sample, score, print a table."""
    import tyro
    from transformers import AutoModelForCausalLM

    from .config import DataConfig
    from .data import load_prompts
    from .reward import get_verifier
    from .rollout.torch_engine import TorchEngine
    from .tokenizer import eos_token_ids, load_tokenizer

    base, rest, start = starting_point(argv, None)
    cls = eval_args_class(base)
    args = tyro.cli(cls, args=rest, prog="flashdapo eval",
                    description=f"{cls.__doc__}\n\nDefaults: {start} (--preset NAME, --config FILE).")
    try:
        verifier = get_verifier(args.verifier)
    except ImportError as err:
        raise ConfigError(f"{field_path(cls, 'verifier')}: {err}") from err
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    tokenizer = load_tokenizer(args.model)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    dataset = load_prompts([args.data], tokenizer, DataConfig(max_prompt_length=args.max_prompt_length,
                                                              dedup=True))
    print(f"flashdapo eval: {dataset.report.summary()}")
    engine = TorchEngine(model, eos_token_ids(tokenizer), tokenizer.pad_token_id, device, max_batch=args.batch_size)
    start_time = time.perf_counter()
    result = evaluate(engine, dataset.prompts, tokenizer, verifier, args.k, args.temperature,
                      args.top_p, args.max_new_tokens, args.seed)
    print(format_table(Path(args.data).name, len(dataset), result, time.perf_counter() - start_time))
    return result


def format_table(name: str, num_prompts: int, result: EvalResult, seconds: float) -> str:
    """A Markdown table of the eval metrics."""
    m = result.metrics("eval")
    rows = [("data", name), ("prompts", str(num_prompts)), ("k", str(result.k)),
            (f"mean@{result.k}", f"{m['eval/acc/mean@k']:.4f}"), (f"pass@{result.k}", f"{m['eval/acc/pass@k']:.4f}"),
            (f"maj@{result.k}", f"{m['eval/acc/maj@k']:.4f}"),
            ("mean response length", f"{m['eval/response_length/mean']:.1f}"),
            ("truncated fraction", f"{m['eval/response_length/clip_ratio']:.4f}"), ("wall time (s)", f"{seconds:.1f}")]
    width = max(len(r[0]) for r in rows)
    lines = [f"| {'metric':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
    return "\n".join(lines)

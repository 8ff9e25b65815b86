"""`flashdapo eval`: evaluate a saved model (HF directory) on parquet/jsonl files, as DAPO reports it.

Its options are fields of the config tree: each takes its type, checks, help and default from the field
it stands for (`--k` is `rollout.val_n`), starting from the tree's defaults (the paper's evaluation
settings), or from `--preset NAME` / `--config FILE` (e.g. a run's config.yaml). Every option is
checked before the model is loaded.

Under torchrun every rank loads the whole model (torch engine: a plain replica per device, no
collectives inside generate) or its tensor-parallel part (vLLM, `--tensor-parallel-size`), samples its
share of the prompts (eval/sampling.py), and rank 0 gathers the results, appends them to OUT/samples.jsonl,
writes OUT/metrics.json (eval/store.py) and prints a table per data source. A plain `flashdapo eval`
is the same with one rank.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import operator
from pathlib import Path
from typing import Any, Literal

import torch

from ..config import (
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
    engine_spec,
    starting_point,
)
from ..config.checks import (
    BATCH_MAX,
    BATCH_WHY,
    IS_PATH,
    Check,
    Rule,
    Section,
    at_most,
    field_docs,
    field_path,
    field_spec,
    ge,
    register_tree,
)
from ..data import load_eval_prompts
from ..distributed.failfast import FailFast
from ..distributed.mesh import DistEnv, init_distributed
from ..models.adapter_dir import is_adapter_dir
from ..models.hf import resolved_attention
from ..preflight import check_engine, check_model
from ..rollout.engine_models import check_engine_model
from ..rollout.factory import build_engine, world_group
from .adapter import ModelSource, adapter_line, model_source, serving_adapter
from .results import EvalReport, format_report
from .sampling import EvalSampling, Shard, evaluate_to_dir
from .store import SampleLog

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
    "engine": "rollout.engine",
    "tensor_parallel_size": "rollout.tensor_parallel_size",
    "kv_cache_gib": "rollout.kv_cache_gib",
}
"""Each option of `flashdapo eval` and the config field it stands for."""




def _are_files(paths: list[str]) -> bool:
    return bool(paths) and all(p.endswith((".parquet", ".jsonl")) and Path(p).is_file() for p in paths)


def _distinct_files(paths: list[str]) -> bool:
    """No file given twice (under two spellings either: `a.jsonl`, `./a.jsonl`, a link to it)."""
    resolved = [Path(p).resolve() for p in paths]
    return len(set(resolved)) == len(resolved)


def base_option(option: Any) -> Any:
    """eval's and generate's --base (`option`: config/cli.py's, which needs tyro)."""
    return option(str, "With a LoRA adapter directory as --model: the base model directory, in place of the "
                  "one its adapter_config.json names (base_model_name_or_path), e.g. after the run moved. "
                  "Default: that one.", IS_PATH,
                  Check(lambda p: not p or Path(p).is_dir(), "an existing model directory, or ''"))


BASE_RULE = Rule("base", lambda a: not a.base or is_adapter_dir(a.model),
                 lambda a: f"'' (--base is the base of an adapter directory; --model {a.model} holds no "
                 "adapter_config.json)")
"""--base only with an adapter as --model."""


def tree_options(base: Config, options: dict[str, str]) -> list[tuple[str, Any, Any]]:
    """(name, annotated type, field) of each option standing for a config field (`options`: name -> field
    path): the field's type, checks and help, `base`'s value as the default."""
    from ..config.cli import option  # the command line alone needs tyro

    fields = []
    for name, path in options.items():
        section_path, _, leaf = path.rpartition(".")
        section = operator.attrgetter(section_path)(base)
        tp, checks = field_spec(type(section), leaf)
        help_text = " ".join(field_docs(type(section))[leaf].split()) + f" (config field {path})"
        fields.append((name, option(tp, help_text,
                                    *checks), dataclasses.field(default=getattr(section, leaf))))
    return fields


def eval_args_class(base: Config) -> type:
    """The dataclass tyro parses `flashdapo eval` into: --model, --data, then the OPTIONS with `base`'s values
    as defaults. Building it checks every option (types and ranges of the tree, files, CUDA)."""
    from ..config.cli import option  # the command line alone needs tyro

    fields: list[tuple[str, Any, Any]] = [
        ("model",
         option(str, "Local HF model directory (e.g. a run's export/ folder), or a PEFT LoRA adapter "
                "directory (a LoRA run's export/: adapter_config.json; its base is loaded and the adapter "
                "applied).", IS_PATH, Check(lambda p: Path(p).is_dir(), "an existing directory")), ...),
        ("data",
         option(
             list[str], "Evaluation files, e.g. aime-2024.parquet math500.parquet; metrics are reported "
             "per data source (the data_source column, else the file name) and pooled; "
             "each file once.", IS_PATH, Check(_are_files, "one or more existing .parquet or .jsonl files"),
             Check(_distinct_files, "each file once (one given twice would count its problems twice)")), ...),
        ("out",
         option(
             str, "Output directory: samples.jsonl (appended per prompt; a rerun with the same OUT "
             "resumes) and metrics.json.", IS_PATH), ...),
        ("base", base_option(option), ""),
        ("prompts_per_call",
         option(
             int,
             "Prompts per rank per generate call. 0: 1 with the torch engine (a prompt's samples then depend "
             f"only on the seed and the prompt), {engine_spec('vllm').prompts_per_call} with vllm.", ge(0),
             at_most(BATCH_MAX, BATCH_WHY)), 0),
        ("progress",
         option(bool, "Show prompts done / total, tokens/s and the ETA (`--no-progress`: false)."), True),
        ("fsdp",
         option(
             bool, "torch engine: shard the model over the ranks with FSDP2 as in training (rank 0 reads the "
             "checkpoint; every forward gathers one block at a time), for a model that does not fit one "
             "device. Samples then depend on the rank count. Default: a whole replica per rank (`--fsdp` "
             "alone: true)."), False),
        ("sources",
         option(
             Literal["column", "file"],
             "What a data source is: 'column', the data_source column (the file name "
             "where it is absent), or 'file', the file name (the public AIME-2024 "
             "parquet says math_dapo, as the training set does)."), "column"),
    ]
    fields += tree_options(base, OPTIONS)
    fields = [(n, t) if d is ... else
              (n, t, dataclasses.field(default=d) if not isinstance(d, dataclasses.Field) else d)
              for n, t, d in fields]
    cls = dataclasses.make_dataclass("EvalArgs", fields, bases=(Section,))
    cls.__doc__ = "Evaluate a saved model (HF directory) on a parquet/jsonl in the DAPO / AIME-2024 schema."
    cls.RULES = (Rule("device", lambda a: a.device != "cuda" or torch.cuda.is_available(),
                      lambda a: "'auto' or 'cpu' (CUDA is not available)"),
                 BASE_RULE,
                 Rule("fsdp", lambda a: not (a.fsdp and engine_spec(a.engine).own_weights),
                      lambda a: "false with --engine vllm "
                      "(vLLM shards with --tensor-parallel-size)"))
    register_tree(cls, "eval.")
    return cls


EVAL_SWITCHES = ("--progress", "--fsdp")
"""eval's bools that may stand alone (`--fsdp` = `--fsdp true`, `--no-progress` = `--progress false`)."""


def eval_main(argv: list[str]) -> EvalReport:
    """`flashdapo eval`: check the options (the parser of every command, config/cli.py), then evaluate
    (`run_eval`)."""
    from ..config.cli import parse  # the command line alone needs tyro

    base, rest, start = starting_point(argv, None)
    cls = eval_args_class(base)
    args = parse(cls, rest, prog="flashdapo eval", switches=EVAL_SWITCHES,
                 description=f"{cls.__doc__}\n\nDefaults: {start} (--preset NAME, --config FILE).")
    from ..reward import RANDOM_VERIFIER

    if args.verifier == RANDOM_VERIFIER:  # a training control, not a judge of answers
        raise ConfigError(f"{field_path(cls, 'verifier')}: 'random' is a training reward (the reward-free "
                          "control); evaluate with dapo, dapo_verl or math_verify")
    try:
        from ..reward import get_verifier

        get_verifier(args.verifier)
    except ImportError as err:
        raise ConfigError(f"{field_path(cls, 'verifier')}: {err}") from err
    check_engine(args.engine, field_path(cls, "engine"))
    return run_eval(args)


def eval_engine(args: Any, env: DistEnv, tokenizer, vllm_module: Any = None,
                source: ModelSource | None = None):
    """The rollout engine `args.engine` names, holding the saved model at `args.model` on this rank
    (rollout.build_engine): a full replica per rank, FSDP2 shards with --fsdp, or an engine of its own.
    A LoRA adapter as --model (`source`, default: `model_source(args)`; eval/adapter.py): its base with the
    adapter merged (torch), or vLLM on the base serving the adapter."""
    source = source or model_source(args)
    adapter = source.adapter
    on_gpu = env.device.type == "cuda"
    dtype = "bfloat16" if on_gpu else "float32"
    attention = eval_attention(source.model)
    rollout = RolloutConfig(engine=args.engine, tensor_parallel_size=args.tensor_parallel_size,
                            kv_cache_gib=getattr(args, "kv_cache_gib", 0.0),
                            max_num_seqs=getattr(args, "batch_size", RolloutConfig.max_num_seqs))
    out = getattr(args, "out", None)
    if adapter is not None and env.is_main:
        print(f"flashdapo: {adapter_line(source, args.engine)}", flush=True)
    common = dict(model_path=source.model, dtype=dtype, seed=args.seed, dummy_weights=False,
                  vllm_module=vllm_module, max_model_len=args.max_prompt_length + args.max_new_tokens,
                  error_log=Path(out) / f"vllm-error.rank{env.rank}.log" if out else None)
    if engine_spec(args.engine).own_weights:
        if adapter is not None:
            common["vllm_module"] = serving_adapter(vllm_module or importlib.import_module("vllm"), adapter)
        return build_engine(rollout, env, tokenizer, **common)
    # A quantized checkpoint (fp8 block-wise, mxfp4) is dequantized into the plain model, said in one line
    # (models/quantized.py).
    said = (lambda m: print(f"flashdapo: {m}", flush=True)) if env.is_main else None
    if getattr(args, "fsdp", False):  # `flashdapo generate` has no --fsdp
        from ..models.loading import load_sharded_policy

        cfg = Config(model=ModelConfig(path=source.model, dtype=dtype, attn_implementation=attention),
                     trainer=TrainerConfig(device=args.device))
        policy = load_sharded_policy(cfg, env, said, "sampling", adapter=adapter.path if adapter else "")
        # Never woken: the shards stay sharded and each forward gathers one block at a time.
        return build_engine(rollout, env, tokenizer, model=policy, shard_group=world_group(env), **common)
    from ..models.quantized import load_pretrained

    model = load_pretrained(source.model, torch.bfloat16 if on_gpu else torch.float32, attention, said,
                            source.field, "sampling")
    if adapter is not None:
        from ..models.adapter_dir import merge_adapter

        model = merge_adapter(model, adapter.path)
    # No process group: each rank holds a full replica and generates on its own, seeded per prompt only.
    return build_engine(rollout, env, tokenizer, model=model.to(env.device), **common)


def eval_attention(model_dir: str) -> str:
    """The attention implementation a torch engine samples the model at `model_dir` with: SDPA, or eager for a
    family whose attention transformers' SDPA path cannot honour (models/hf.py ATTENTION_REFUSED: Gemma 2's
    attention-logit cap, GPT-OSS's sinks), where training would refuse SDPA."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return resolved_attention("auto", config)


def prompts_per_call(args: Any) -> int:
    """--prompts-per-call, or its engine's default (0)."""
    return args.prompts_per_call or engine_spec(args.engine).prompts_per_call


def eval_settings(args: Any, source: ModelSource | None = None) -> dict[str, Any]:
    """What determines the samples; a resumed evaluation must match it (see eval/store.py). An adapter's
    base is part of it (`source`)."""
    base = {"base": str(Path(source.model).resolve())} if source is not None and source.adapter else {}
    return {"model": str(Path(args.model).resolve()), **base,
            "data": [str(Path(f).resolve()) for f in args.data],
            "k": args.k, "temperature": args.temperature, "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens, "max_prompt_length": args.max_prompt_length,
            "seed": args.seed, "verifier": args.verifier, "engine": args.engine,
            "prompts_per_call": prompts_per_call(args), "sources": args.sources, "fsdp": args.fsdp}


def run_eval(args: Any, vllm_module: Any = None) -> EvalReport:
    """Evaluate `args.model` on `args.data` into `args.out`; print the table on rank 0; return the report."""
    from ..reward import get_verifier

    source = model_source(args)  # a LoRA adapter: every check reads its base (eval/adapter.py)
    # As train does: a sample past the model's positions is out of its range (vLLM refuses it; the torch
    # engine would sample on, silently).
    checked = check_model(source.model, source.field, args.max_prompt_length + args.max_new_tokens,
                          "--max-prompt-length + --max-new-tokens")
    # What the engine builds of this model (vLLM: its architectures, per-layer windows), before it starts.
    # vLLM loads from disk
    check_engine_model(args.engine, checked.config, source.where(), pushed=False)
    env = init_distributed(args.device)
    failfast = FailFast.connect(env.rank, env.world_size)  # one rank's failure ends every rank
    failfast.watch()
    log = None
    try:
        tokenizer = checked.tokenizer
        for note in checked.notes if env.is_main else []:
            print(f"flashdapo eval: {note}", flush=True)
        dataset = load_eval_prompts(list(args.data), tokenizer,
                                    DataConfig(max_prompt_length=args.max_prompt_length))
        prompts = dataset.prompts if args.sources == "column" else [
            dataclasses.replace(p, data_source=Path(p.source.rsplit(":", 1)[0]).stem) for p in dataset.prompts
        ]
        if env.is_main:
            print(f"flashdapo eval: {dataset.report.summary()}; {env.world_size} rank(s) on {env.device}, "
                  f"{args.engine} engine", flush=True)
            for warning in dataset.report.warnings:
                print(f"flashdapo eval: warning: {warning}", flush=True)
        # OUT is claimed (locked, its settings compared) before the model loads: a wrong OUT fails first.
        log = SampleLog(args.out, eval_settings(args, source)) if env.is_main else None
        engine = eval_engine(args, env, tokenizer, vllm_module, source)
        sampling = EvalSampling(k=args.k, temperature=args.temperature, top_p=args.top_p,
                                max_new_tokens=args.max_new_tokens, seed=args.seed,
                                prompts_per_call=prompts_per_call(args))
        report = evaluate_to_dir(engine, prompts, tokenizer, get_verifier(args.verifier), sampling, log,
                                 Shard(env.rank, env.world_size), args.progress)
        if env.is_main:
            print(format_report(report))
            print(
                f"flashdapo eval: per-prompt samples in {Path(args.out) / 'samples.jsonl'}; metrics (pass@j "
                "and "
                f"maj@j for every j) in {Path(args.out) / 'metrics.json'}", flush=True)
    except BaseException as err:
        failfast.end(err)
        raise
    finally:
        if log is not None:
            log.close()
    failfast.end(None)
    return report

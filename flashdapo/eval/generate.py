"""`flashdapo generate`: a saved model's answers to a few prompts, judged where the answer is known.

    flashdapo generate --model DIR (--prompt TEXT [TEXT ...] | --data FILE [--limit N] | --examples)
                       [--n 4] [--engine torch|vllm] [--out FILE.jsonl] [--config FILE | --preset NAME]

It goes the way of `flashdapo eval` (eval/command.py): the same model and tokenizer checks, engine and
sampling (`sample_prompts`: the model's chat template, one generate call per prompt with the torch engine,
every response decoded and verified), with the evaluation's sampling fields of the config tree
(rollout.val_temperature, val_top_p, max_response_length, from `--config`/`--preset` or the defaults).
A `--prompt` is one user message as typed (no template added) and has no ground truth; `--data` rows and
`--examples` (a few DAPO-format math problems, eval/examples.py) have theirs, so each of their responses shows
the verifier's verdict. `--out` writes one JSON object per prompt with its responses, as eval's samples.jsonl
does. One process (a rank of its own); every option is checked before the model loads.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError, DataConfig, engine_spec, starting_point
from ..config.checks import IS_PATH, Check, Rule, Section, at_most, field_path, ge, register_tree
from ..config.sampling import SAMPLES_MAX
from ..data import DAPO_TEMPLATE, Record, chat_ids, prompts_from_records, read_records
from ..distributed.mesh import init_distributed, shutdown
from ..errors import file_in_the_way
from ..preflight import check_engine, check_model
from ..rollout.engine_models import check_engine_model
from .adapter import model_source
from .command import BASE_RULE, OPTIONS, base_option, eval_engine, tree_options
from .examples import example_records
from .results import PromptResult
from .sampling import EvalSampling, sample_prompts
from .store import EvalStoreError

GENERATE_OPTIONS = {name: path for name, path in OPTIONS.items() if name != "k"}
"""The options of `flashdapo eval` that `generate` shares (its --n stands for eval's --k)."""
PROMPT_CHARS = 240
"""A prompt is printed up to this many characters (its responses in full)."""


def _data_file(path: str) -> bool:
    return not path or (path.endswith((".parquet", ".jsonl")) and Path(path).is_file())


def generate_args_class(base: Config) -> type:
    """The dataclass the command line parses `flashdapo generate` into; building it checks every option."""
    from ..config.cli import option as opt  # the command line alone needs tyro

    fields: list[tuple[str, Any, Any]] = [
        ("model",
         opt(
             str, "Local HF model directory (e.g. a run's export/ folder), or a PEFT LoRA adapter "
             "directory (a LoRA run's export/: adapter_config.json; its base is loaded and the adapter "
             "applied).", IS_PATH,
             Check(lambda p: bool(p) and Path(p).is_dir(),
                   "an existing model directory (e.g. runs/toy/export)")), ""),
        ("base", base_option(opt), ""),
        ("prompt",
         opt(list[str], "Prompts, each one user message of the chat template, as typed (no ground truth).",
             Check(lambda ps: all(p.strip() for p in ps),
                   "prompts with text")), dataclasses.field(default_factory=list)),
        ("data",
         opt(str, "A .parquet or .jsonl file in the DAPO-Math-17k schema (or {problem, answer} rows).",
             IS_PATH, Check(_data_file, "an existing .parquet or .jsonl file")), ""),
        ("limit", opt(int, "With --data: its first N prompts (0: all).", ge(0)), 0),
        ("examples",
         opt(
             bool, "A few math problems in the DAPO format, with their answers (eval/examples.py; "
             "`--examples` alone: true)."), False),
        ("n",
         opt(int, "Responses per prompt.", ge(1), at_most(SAMPLES_MAX,
                                                          "responses per prompt held together")), 4),
        ("out",
         opt(
             str, "Also write the responses to this .jsonl file (one prompt per line, as eval's "
             "samples.jsonl).", IS_PATH), ""),
        *tree_options(base, GENERATE_OPTIONS),
    ]
    fields = [(n, t, d if isinstance(d, dataclasses.Field) else dataclasses.field(default=d))
              for n, t, d in fields]
    cls = dataclasses.make_dataclass("GenerateArgs", fields, bases=(Section,))
    cls.__doc__ = "Sample a saved model's responses to a few prompts; judge them where the answer is known."
    cls.RULES = (
        Rule("prompt", lambda a: bool(a.prompt) + bool(a.data) + a.examples == 1,
             lambda a: "exactly one source of prompts: --prompt TEXT [TEXT ...], --data FILE or --examples"),
        BASE_RULE)
    register_tree(cls, "generate.")
    return cls


def generate_main(argv: list[str]) -> list[PromptResult]:
    """`flashdapo generate`: check the options (the parser of every command, config/cli.py), then sample,
    print and write (`run_generate`)."""
    from ..config.cli import parse  # the command line alone needs tyro

    base, rest, start = starting_point(argv, None)
    cls = generate_args_class(base)
    args = parse(cls, rest, prog="flashdapo generate", switches=("--examples",),
                 description=f"{cls.__doc__}\n\nDefaults: {start} (--preset NAME, --config FILE).")
    try:
        from ..reward import get_verifier

        get_verifier(args.verifier)
    except ImportError as err:
        raise ConfigError(f"{field_path(cls, 'verifier')}: {err}") from err
    check_engine(args.engine, field_path(cls, "engine"))
    return run_generate(args)


def _records(args: Any) -> list[Record]:
    if args.examples:
        return example_records()
    if args.data:
        records = read_records(args.data)
        return records[:args.limit] if args.limit else records
    return [
        Record([{"role": "user", "content": text}], "", f"--prompt {i}") for i, text in enumerate(args.prompt)
    ]


def warn_long_prompts(records: list[Record], tokenizer: Any, limit: int) -> None:
    """A warning line for a prompt longer than --max-prompt-length (chat template included): it is cut on the
    left, as training cuts it, and the model sees only its end."""
    for record in records:
        length = len(chat_ids(tokenizer, record.messages))
        if length > limit:
            warnings.warn(
                f"{record.source}: the prompt has {length:,} tokens (chat template included), more than "
                f"--max-prompt-length {limit:,}: only its last {limit:,} are sampled from (cut on the "
                "left, as training cuts it); raise --max-prompt-length to keep it whole", stacklevel=2)


def run_generate(args: Any) -> list[PromptResult]:
    """Sample `args.n` responses per prompt from `args.model`, print them with their verdicts, write
    `args.out`."""
    from ..reward import get_verifier

    if args.out:
        check_out(args.out)  # before any sampling: a path that cannot be written fails first
    source = model_source(args)  # a LoRA adapter: every check reads its base (eval/adapter.py)
    checked = check_model(source.model, source.field, args.max_prompt_length + args.max_new_tokens,
                          "--max-prompt-length + --max-new-tokens",
                          "error" if engine_spec(args.engine).refuses_long_context else "note")
    # What the engine builds of this model (vLLM: its architectures, per-layer windows), before it starts.
    # vLLM loads from disk
    check_engine_model(args.engine, checked.config, source.where(), pushed=False)
    env = init_distributed(args.device)
    try:
        tokenizer = checked.tokenizer
        for note in checked.notes:
            print(f"flashdapo generate: {note}", flush=True)
        records = _records(args)
        warn_long_prompts(records, tokenizer, args.max_prompt_length)
        # Each record a prompt of its own (no dedup), truncated on the left as training does.
        prompts = prompts_from_records(records, tokenizer,
                                       DataConfig(max_prompt_length=args.max_prompt_length,
                                                  dedup=False)).prompts
        engine = eval_engine(args, env, tokenizer, source=source)
        sampling = EvalSampling(k=args.n, temperature=args.temperature, top_p=args.top_p,
                                max_new_tokens=args.max_new_tokens, seed=args.seed,
                                prompts_per_call=engine_spec(args.engine).prompts_per_call)
        print(
            f"flashdapo generate: {len(prompts)} prompt(s) x {args.n} responses, {args.engine} engine on "
            f"{env.device} (temperature {args.temperature}, top_p {args.top_p}, up to {args.max_new_tokens} "
            "new "
            "tokens)", flush=True)
        results = sample_prompts(engine, prompts, tokenizer, get_verifier(args.verifier), sampling)
    finally:
        shutdown()
    texts = {r.source: r.messages[-1]["content"] for r in records}
    for result in results:
        print(format_result(result, texts.get(result.source, result.prompt), args.n), flush=True)
    if args.out:
        write_jsonl(results, Path(args.out))
    print(summary_line(results, args.out), flush=True)
    return results


def check_out(out: str) -> None:
    """`--out` is a file flashdapo can write: not a directory, its folder created (or there) and writable.
    Probed by opening it for appending (an existing file is not changed; one created is removed again), so a
    wrong path is one line before the model loads. EvalStoreError naming it."""
    path = Path(out)
    if path.is_dir():
        raise EvalStoreError(f"--out {out} is a directory; give a file path for the responses (e.g. "
                             f"{path / 'responses.jsonl'})")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except (FileExistsError, NotADirectoryError) as err:
        raise EvalStoreError(
            f"--out {out}: cannot create it, {file_in_the_way(path)} is a file, not a directory; "
            "choose another path") from err
    except OSError as err:
        raise EvalStoreError(
            f"--out {out}: cannot write it ({err.strerror or err}"
            f"{': ' + str(err.filename) if err.filename and str(err.filename) != out else ''}); "
            "fix its permissions or choose another path") from err
    if not existed:
        path.unlink(missing_ok=True)


def format_result(result: PromptResult, text: str, n: int) -> str:
    """A prompt (shortened; of a prompt in the DAPO template, the problem alone), its ground truth, then each
    response with its length, how it ended and, where the ground truth is known, the verdict."""
    head, _, tail = DAPO_TEMPLATE.partition("{problem}")
    kind = "problem" if text.startswith(head) and text.endswith(tail) else "prompt"  # the template said once
    shown = " ".join(_printable(text[len(head):len(text) - len(tail)] if kind == "problem" else text).split())
    shown = shown if len(shown) <= PROMPT_CHARS else shown[:PROMPT_CHARS - 3] + "..."
    truth = f"  ground truth: {result.ground_truth}" if result.ground_truth else ""
    lines = ["", f"[{result.prompt_id + 1}] {result.source}{truth}", f"    {kind}: {shown}"]
    for i, s in enumerate(result.samples, start=1):
        verdict = ""
        if result.ground_truth:
            verdict = ": " + ("correct" if s.acc else "wrong") + (f" (answer {s.pred})"
                                                                  if s.pred else " (no answer)")
        lines.append(f"  response {i}/{n} ({s.length} tokens, {s.finish_reason}){verdict}")
        lines += ["    " + line for line in (_printable(s.response).strip() or "(empty)").splitlines()]
    return "\n".join(lines)


def _printable(text: str) -> str:
    """`text` with control characters (an untrained model samples any byte) shown as U+FFFD."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


def summary_line(results: list[PromptResult], out: str) -> str:
    judged = [s for r in results if r.ground_truth for s in r.samples]
    correct = f"{sum(s.acc for s in judged)} of {len(judged)} responses correct" if judged else \
        "no ground truth, no verdicts"
    return f"\nflashdapo generate: {correct}" + (f"; written to {out}" if out else "")


def write_jsonl(results: list[PromptResult], path: Path) -> None:
    """One JSON object per prompt (PromptResult.to_dict: prompt, ground truth, each response judged)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in results), encoding="utf-8")
    except OSError as err:
        raise EvalStoreError(
            f"--out {path}: cannot write the responses ({err.strerror or err}); they are printed "
            "above: free disk space (or fix the error) and run again to write them") from err


__all__ = ["generate_args_class", "generate_main", "run_generate"]

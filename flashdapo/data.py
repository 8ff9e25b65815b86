"""Prompt datasets: DAPO-Math-17k-schema parquet/jsonl or {problem, answer} jsonl, tokenized, and the sampler.

Choices, stated first:
- A file row becomes a `Record` (chat messages + ground truth); the tokenizer's chat template with the
  generation prompt turns it into a `Prompt` (token ids). Plain {problem, answer} rows are wrapped in
  the DAPO prompt template as one user message (docs/algorithm.md, section 4).
- Bad input stops with a `DataError` naming the file, the 0-based row and what was expected; no row is
  ever skipped silently. Rows that load but look wrong (an empty user message, a role other than system,
  user or assistant, a conversation ending in an assistant turn, a prompt seen with two different ground
  truths) are counted into warnings, one per file and kind, naming the first row (`record_warnings`). Prompts
  over the budget are left-truncated (DAPO), dropped or refused, and counted; exact-duplicate prompts (same
  messages) are counted and optionally removed (the public DAPO-Math-17k file holds each problem ~100 times).
  Duplicates are tokenized once and share ids.
- `PromptSampler` walks a deterministic permutation per epoch; every rank computes the same global
  batch and takes its contiguous slice, so the state (epoch, global position) resumes at any world size.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import DataConfig
from .errors import FlashdapoError
from .reward import MAX_GROUND_TRUTH_CHARS

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


class DataError(FlashdapoError, ValueError):
    """A data file is unreadable or malformed; the message names the file, the row and what was expected."""


@dataclass
class Record:
    """One dataset row before tokenization."""

    messages: list[dict[str, str]]
    """Chat messages, each {role, content}."""
    ground_truth: str
    """Reference answer the verifier compares with."""
    source: str
    """'file:row' (0-based row), for error messages and debugging."""
    data_source: str = ""
    """The row's `data_source` column (e.g. 'math_dapo'); the file's name without extension when absent."""


@dataclass
class Prompt:
    """A tokenized prompt. `ids` may be shared between duplicate prompts: do not mutate it."""

    ids: list[int]
    """Token ids after the chat template with generation prompt (possibly left-truncated)."""
    ground_truth: str
    source: str
    """'file:row' (0-based row)."""
    data_source: str = ""


# ---------------------------------------------------------------------------------------------------
# Reading files


def _where(path: str | Path, row: int) -> str:
    return f"{path}: row {row} (0-based)"


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    ok = isinstance(value, (list, tuple)) and len(value) > 0
    if ok:
        for m in value:
            ok = ok and isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(
                m.get("content"), str)
    if not ok:
        raise DataError(
            f"{where}: 'prompt' must be a non-empty list of {{role, content}} messages with string "
            f"values, got {str(value)[:120]!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _ground_truth(value: Any, where: str, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataError(f"{where}: {name} must be a non-empty string (or an integer), got {value!r}")
    text = str(value)
    if not text.strip():
        raise DataError(f"{where}: {name} is empty")
    if len(text) > MAX_GROUND_TRUTH_CHARS:
        raise DataError(f"{where}: {name} has {len(text):,} characters; an answer has at most "
                        f"{MAX_GROUND_TRUTH_CHARS:,} (is the solution in the answer column?)")
    return text


def _dapo_row(row: dict[str, Any], where: str, source: str) -> Record:
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise DataError(f"{where}: expected reward_model.ground_truth, got reward_model={reward_model!r}")
    return Record(_messages(row.get("prompt"), where),
                  _ground_truth(reward_model["ground_truth"], where, "reward_model.ground_truth"),
                  source, str(row.get("data_source") or ""))


def _jsonl_row(row: Any, where: str, source: str) -> Record:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "prompt" in row:
        return _dapo_row(row, where, source)
    if "problem" in row:
        if not isinstance(row["problem"], str) or not row["problem"].strip():
            raise DataError(f"{where}: 'problem' must be a non-empty string, got {row['problem']!r}")
        if row.get("answer") is None:
            raise DataError(f"{where}: a {{problem, answer}} row needs an 'answer'")
        content = DAPO_TEMPLATE.format(problem=row["problem"])
        return Record([{"role": "user", "content": content}], _ground_truth(row["answer"], where, "'answer'"),
                      source, str(row.get("data_source") or ""))
    raise DataError(f"{where}: expected 'prompt' + 'reward_model' (DAPO-Math-17k schema) or 'problem' + "
                    f"'answer', got keys {sorted(row)}")


def _read_jsonl(path: Path) -> list[Record]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read the file ({err})") from err
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for row, line in enumerate(lines):
        where = _where(path, row) + f" (line {row + 1})"
        if not line.strip():
            raise DataError(f"{where}: empty line; expected one JSON object per line")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from err
        records.append(_jsonl_row(obj, where, f"{path}:{row}"))
    return records


def _read_parquet(path: Path) -> list[Record]:
    import pyarrow as pa  # imported here: the toy task and jsonl data need no pyarrow
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: cannot read the file as parquet ({err})") from err
    names = file.schema_arrow.names
    for column in ("prompt", "reward_model"):
        if column not in names:
            raise DataError(
                f"{path}: column {column!r} is missing (DAPO-Math-17k schema: prompt, reward_model"
                f"; the file has {names})")
    columns = ["prompt", "reward_model"] + (["data_source"] if "data_source" in names else [])
    records: list[Record] = []
    shared: dict[tuple, list[dict[str, str]]] = {}  # the public 17k file repeats each prompt ~100x
    try:
        for batch in file.iter_batches(batch_size=8192, columns=columns):
            for item in batch.to_pylist():
                row = len(records)
                record = _dapo_row(item, _where(path, row), f"{path}:{row}")
                key = tuple((m["role"], m["content"]) for m in record.messages)
                record.messages = shared.setdefault(key, record.messages)
                records.append(record)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: cannot read the parquet data after row {len(records)} ({err})") from err
    return records


def read_records(path: str | Path) -> list[Record]:
    """Read a .parquet or .jsonl file of prompts (DAPO-Math-17k schema, or {problem, answer} jsonl)."""
    path = Path(path)
    if path.suffix not in (".parquet", ".jsonl"):
        raise DataError(f"{path}: unknown extension {path.suffix!r}; expected .parquet or .jsonl")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = _read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path)
    for record in records:  # evaluation reports per data source: rows without one are named by their file
        record.data_source = record.data_source or path.stem
    return records


# ---------------------------------------------------------------------------------------------------
# Tokenized datasets


@dataclass
class DatasetReport:
    """What loading did: counts the trainer prints once."""

    rows: int
    """Rows read (all files)."""
    duplicates: int
    """Rows whose messages equal an earlier row's."""
    removed: int
    """Duplicates removed (cfg.dedup)."""
    truncated: int
    """Prompts left-truncated to max_prompt_length."""
    dropped: int
    """Prompts dropped for exceeding max_prompt_length (truncation='drop')."""
    files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """Rows that loaded but look wrong, one line per file and kind (`record_warnings`); the caller logs
    them."""

    def summary(self) -> str:
        """One line for the console."""
        names = ", ".join(Path(f).name for f in self.files) or "none"
        unique = self.rows - self.duplicates
        return (f"{self.rows} rows from {names}: {unique} unique prompts, {self.duplicates} duplicates "
                f"({self.removed} removed), {self.truncated} truncated, {self.dropped} dropped")


@dataclass
class PromptDataset:
    """Tokenized prompts in file order, and the loading report."""

    prompts: list[Prompt]
    report: DatasetReport

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], where: str = "") -> list[int]:
    """Token ids of `messages` (the prompt at `where`) under the tokenizer's chat template with the generation
    prompt. A template that fails on them (jinja2's errors: transformers' sandbox refusing it, a
    raise_exception) is a DataError naming the prompt and the tokenizer."""
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    except Exception as err:
        if not type(err).__module__.startswith("jinja2"):
            raise
        owner = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise DataError(
            f"{where or 'a prompt'}: the chat template of {owner} fails on it ({type(err).__name__}: "
            f"{' '.join(str(err).split())}); use the model's original tokenizer files, fix the template, "
            "or drop the row") from err
    if hasattr(out, "keys") and "input_ids" in out:  # BatchEncoding / dict (transformers 5 default)
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return [int(i) for i in out]


ROLES = ("system", "user", "assistant")
"""Chat roles the templates know."""


def record_warnings(records: list[Record]) -> list[str]:
    """One line per file and kind of suspicious row, counted, naming the first row: an empty user message, an
    unknown role, a trailing assistant turn (the model would be asked to continue it), and a prompt whose
    ground truth differs from an earlier row's with the same messages (one of them is wrong)."""
    found: dict[tuple[str, str], list[str]] = {}
    first_truth: dict[tuple, Record] = {}
    for record in records:
        file, _, row = record.source.rpartition(":")
        kinds = []
        if any(m["role"] == "user" and not m["content"].strip() for m in record.messages):
            kinds.append(("an empty user message", ""))
        unknown = sorted({m["role"] for m in record.messages} - set(ROLES))
        if unknown:
            kinds.append((f"a role other than {', '.join(ROLES)}", f", role {unknown[0]!r}"))
        if record.messages[-1]["role"] == "assistant":
            kinds.append(("a conversation ending in an assistant turn", ""))
        earlier = first_truth.setdefault(tuple((m["role"], m["content"]) for m in record.messages), record)
        if earlier.ground_truth != record.ground_truth:
            kinds.append(("a prompt seen earlier with another ground truth",
                          f", {record.ground_truth!r} here, {earlier.ground_truth!r} at {earlier.source}"))
        for kind, detail in kinds:
            found.setdefault((file, kind), []).append(f"row {row}{detail}")
    return [
        f"{file}: {len(rows)} row(s) with {kind} (first: {rows[0]})" for (file, kind), rows in found.items()
    ]


def _fit(ids: list[int], record: Record, cfg: DataConfig) -> tuple[list[int] | None, bool]:
    """Apply the length policy: (ids, truncated); ids None means drop."""
    if len(ids) <= cfg.max_prompt_length:
        return ids, False
    if cfg.truncation == "left":
        return ids[-cfg.max_prompt_length:], True
    if cfg.truncation == "drop":
        return None, False
    raise DataError(f"{record.source}: the prompt has {len(ids)} tokens > data.max_prompt_length="
                    f"{cfg.max_prompt_length} (data.truncation='error'; use 'left' or 'drop')")


def prompts_from_records(records: list[Record], tokenizer: Any, cfg: DataConfig,
                         files: list[str] | None = None) -> PromptDataset:
    """Tokenize records (each distinct prompt once), count duplicates, dedup and apply the length policy."""
    if not records:
        raise DataError(f"{', '.join(files or []) or 'dataset'}: no rows")
    seen: dict[tuple, tuple[list[int] | None, bool]] = {}
    prompts, duplicates, truncated, dropped = [], 0, 0, 0
    for record in records:
        key = tuple((m["role"], m["content"]) for m in record.messages)
        if key in seen:
            duplicates += 1
            if cfg.dedup:
                continue
        else:
            seen[key] = _fit(chat_ids(tokenizer, record.messages, record.source), record, cfg)
        ids, was_truncated = seen[key]
        if ids is None:
            dropped += 1
            continue
        truncated += was_truncated
        prompts.append(Prompt(ids, record.ground_truth, record.source, record.data_source))
    if not prompts:
        raise DataError(f"{', '.join(files or []) or 'dataset'}: every prompt was dropped (longer than "
                        f"data.max_prompt_length={cfg.max_prompt_length})")
    report = DatasetReport(len(records), duplicates, duplicates if cfg.dedup else 0, truncated, dropped,
                           list(files or []), record_warnings(records))
    return PromptDataset(prompts, report)


def load_prompts(files: list[str], tokenizer: Any, cfg: DataConfig) -> PromptDataset:
    """Read, tokenize and check prompt files (see `read_records`, `prompts_from_records`)."""
    records = [record for path in files for record in read_records(path)]
    return prompts_from_records(records, tokenizer, cfg, [str(f) for f in files])


def load_eval_prompts(files: list[str], tokenizer: Any, cfg: DataConfig) -> PromptDataset:
    """Evaluation sets: each file deduplicated on its own (AIME-2024 holds each problem 32 times), so a
    problem that two files share is evaluated under both files' data sources and neither table loses it."""
    per_file = [load_prompts([path], tokenizer, dataclasses.replace(cfg, dedup=True)) for path in files]
    reports = [d.report for d in per_file]
    report = DatasetReport(*(sum(getattr(r, name) for r in reports)
                             for name in ("rows", "duplicates", "removed", "truncated", "dropped")),
                           files=[str(f) for f in files], warnings=[w for r in reports for w in r.warnings])
    return PromptDataset([p for d in per_file for p in d.prompts], report)


# ---------------------------------------------------------------------------------------------------
# Sampling


class PromptSampler:
    """Deterministic, resumable, rank-sharded batches of prompts.

    Each call draws the next `batch_size` prompts of the global order (a fresh permutation per epoch,
    seeded by (seed, epoch); batches may span an epoch boundary) and returns rank `rank`'s contiguous
    slice of `batch_size // world_size` prompts.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1) -> None:
        if len(dataset) == 0:
            raise DataError("PromptSampler: the dataset is empty")
        if batch_size < 1 or world_size < 1 or batch_size % world_size:
            raise DataError(f"PromptSampler: batch_size ({batch_size}) must be a positive multiple of the "
                            f"world size ({world_size})")
        if not 0 <= rank < world_size:
            raise DataError(f"PromptSampler: rank {rank} outside 0..{world_size - 1}")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            n = len(self.dataset)
            perm = (np.random.default_rng([self.seed, epoch]).permutation(n)
                    if self.shuffle else np.arange(n))
            self._order = (epoch, perm)
        return self._order[1]

    def next_indices(self) -> list[int]:
        """Dataset indices of this rank's share of the next global batch (advances the state)."""
        picked: list[int] = []
        while len(picked) < self.batch_size:
            perm = self._permutation(self.epoch)
            take = min(self.batch_size - len(picked), len(perm) - self.position)
            picked += perm[self.position:self.position + take].tolist()
            self.position += take
            if self.position == len(perm):
                self.epoch, self.position = self.epoch + 1, 0
        per_rank = self.batch_size // self.world_size
        return picked[self.rank * per_rank:(self.rank + 1) * per_rank]

    def next_batch(self) -> list[Prompt]:
        """This rank's prompts of the next global batch."""
        return [self.dataset[i] for i in self.next_indices()]

    def state_dict(self) -> dict[str, int | bool]:
        """Position in the global order (independent of rank and world size)."""
        return {"epoch": self.epoch, "position": self.position, "num_prompts": len(self.dataset),
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; the dataset, seed and shuffle flag must match."""
        for key, mine in (("num_prompts", len(self.dataset)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise DataError(f"PromptSampler: cannot resume, the checkpoint's {key} is {state[key]!r} but "
                                f"this run's is {mine!r} (a resumed run must use the same data and seed)")
        if not 0 <= int(state["position"]) < len(self.dataset) or int(state["epoch"]) < 0:
            raise DataError(f"PromptSampler: invalid state {state!r}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

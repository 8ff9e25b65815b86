"""What the policy writes, on disk: training rollouts and validation generations as jsonl in the run dir.

With `logging.dump_rollouts_every N`, at every N-th step (and at validations on such steps, step 0
included) rank 0 writes
- `RUN_DIR/rollouts/train_step_XXXXXX.jsonl`: one line per generated group of the step, in generation
  order (round, rank, position): the prompt, the responses, their shaped scores, correctness and
  truncation, and its status: "trained" (with the advantages it was trained with), "filtered"
  (dynamic sampling dropped it: every response equally right) or "unused" (kept, but beyond
  train_batch). Under rollout.streaming the step's groups are those that finished in it, after those
  kept past the last step's target (listed again, now trained); "round" is the sampler batch counted over
  the run; a group kept past this step's target is "next_step" (it trains at the next step); a group
  still waiting for a carried response is listed at the step it finishes;
- `RUN_DIR/rollouts/val_step_XXXXXX.jsonl`: one line per validation prompt, as `flashdapo eval` writes
  them to samples.jsonl.
A file is replaced whole, so a resumed run rewrites the steps it repeats. A dump is a record for people,
never worth the run: a write that fails (full disk, permissions) warns once and training goes on; later
dumps are tried again.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ...distributed.collectives import all_gather_objects
from ...distributed.mesh import DistEnv
from ...eval.results import PromptResult
from ..batch import Group, TrainBatch

DUMP_DIR = "rollouts"


def dumping(every: int, step: int) -> bool:
    """Whether step `step` dumps (every > 0 and step a multiple of it)."""
    return every > 0 and step % every == 0


_WARNED = False
"""Whether this process has said that a dump write failed (it is said once)."""


def _write_lines(path: Path, rows: list[dict]) -> None:
    global _WARNED
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(path)
    except OSError as err:
        with contextlib.suppress(OSError):  # no partial file left behind (nor a second error)
            tmp.unlink(missing_ok=True)
        if not _WARNED:
            print(f"flashdapo: warning: cannot write the rollout dump {path} ({type(err).__name__}: {err}); "
                  "training goes on, later dumps are tried again", flush=True)
            _WARNED = True


def dump_train_rollouts(run_dir: Path, step: int, generated: list[tuple[Group, bool]], batch: TrainBatch,
                        tokenizer, env: DistEnv, past_target: str = "unused") -> None:
    """Gather every rank's generated groups (each with whether the filter kept it) and the advantages its
    groups were trained with; rank 0 writes the step's file. `past_target`: the status of a kept group
    that did not train ("next_step" under streaming, where it rolls into the next step)."""
    trained: dict[tuple[int, int, int], dict[int, float]] = {}  # origin -> {response in the group: advantage}
    start = 0
    for g in batch.groups:  # a group's responses may train on several slots: each holds some of them
        trained.setdefault(g.origin,
                           {}).update(zip(g.member_indices, batch.advantages[start:start + g.size].tolist()))
        start += g.size
    rows = [{"step": step, "round": g.origin[0], "rank": g.origin[1], "index": g.origin[2],
             "kept": kept,
             "prompt": tokenizer.decode(g.prompt.tolist(), skip_special_tokens=False),
             "responses": tokenizer.batch_decode([r.tolist() for r in g.responses], skip_special_tokens=True),
             "scores": g.scores.tolist(), "acc": g.acc.tolist(), "truncated": g.truncated.tolist()}
            for g, kept in generated]
    everyone = all_gather_objects((rows, trained))
    if not env.is_main:
        return
    merged: dict[tuple[int, int, int], dict[int, float]] = {}
    for _, part in everyone:
        for origin, by_member in part.items():
            merged.setdefault(origin, {}).update(by_member)
    advantages = {origin: [by_member[m] for m in sorted(by_member)] for origin, by_member in merged.items()}
    out = sorted((row for part, _ in everyone for row in part), key=lambda r:
                 (r["round"], r["rank"], r["index"]))
    for row in out:
        adv = advantages.get((row["round"], row["rank"], row["index"]))
        row["status"] = "trained" if adv is not None else past_target if row.pop("kept") else "filtered"
        row["advantages"] = adv
    _write_lines(run_dir / DUMP_DIR / f"train_step_{step:06d}.jsonl", out)


def dump_validation(run_dir: Path, step: int, results: list[PromptResult], is_main: bool) -> None:
    """Rank 0 writes the validation generations of step `step` (results are the same on every rank)."""
    if is_main:
        _write_lines(run_dir / DUMP_DIR / f"val_step_{step:06d}.jsonl", [r.to_dict() for r in results])

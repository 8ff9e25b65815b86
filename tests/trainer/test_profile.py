"""profile.steps: a trace per rank and profiled step that holds every stage's named range, the table printed
beside it (time per range, peak resident set, top ops), the same training as without it, and nothing at all
when profiling is off."""

import json
import re
from collections import Counter

import pytest
import torch

from flashdapo.__main__ import main as cli
from flashdapo.config import ConfigError, ProfileConfig, merge, toy
from flashdapo.kernels import token_logprobs
from flashdapo.preflight import check_layout
from flashdapo.profiling import Recorder, StepProfiler, named, recording, traced
from tests.helpers.runs import TINY, torchrun

RANGES = {"step", "weight_sync", "gen", "reward", "old_log_prob", "adv", "update_actor", "lm_head.forward",
          "lm_head.backward"}
"""The stages of train_step (the StageTimer's) and the LM-head call inside the policy, forward and backward."""
TWO_STEPS = ["--trainer.total-steps", "2", "--checkpoint.save-every", "0", "--checkpoint.export-hf", "False",
             "--model.toy.sft-steps", "0"]


def trace_ranges(path) -> Counter:
    """Named ranges (user annotations) of a Chrome trace JSON, with how often each occurs."""
    events = json.loads(path.read_text())["traceEvents"]
    return Counter(e["name"] for e in events if e.get("cat") == "user_annotation")


def table_rows(text: str) -> dict[tuple[str, ...], tuple[float, int, float]]:
    """(path of range names) -> (seconds, calls, peak RSS MiB) from a printed profile table."""
    rows, open_at = {}, []
    for line in text.splitlines():
        m = re.match(r"^  ( *)(\S+) +([\d.]+) +(\d+) +[\d.]+%(?: +([\d.]+))?$", line)
        if m:
            depth = len(m.group(1)) // 2
            open_at = open_at[:depth] + [m.group(2)]
            rows[tuple(open_at)] = (float(m.group(3)), int(m.group(4)), float(m.group(5) or 0))
    return rows


def test_profiled_step_writes_a_trace_holding_every_stage_and_prints_its_table(tmp_path, capsys):
    run_dir, plain_dir = tmp_path / "run", tmp_path / "plain"
    assert cli(["train", *TINY, *TWO_STEPS, "--logging.run-dir", str(run_dir), "--profile.steps", "1",
                "--profile.memory", "true"]) == 0
    profile = run_dir / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["rank0.1.pt.trace.json", "rank0.1.txt"]  # step 2: none
    found = trace_ranges(profile / "rank0.1.pt.trace.json")
    assert RANGES <= set(found), RANGES - set(found)
    table = (profile / "rank0.1.txt").read_text()
    assert table.strip() in capsys.readouterr().out
    rows = table_rows(table)
    # The table counts the calls the trace holds: old log-probs (2 mini-batches: recomputed) and the update
    # each call the LM head; only the update runs its backward, once per forward.
    head = [path for path in rows if path[-1].startswith("lm_head.")]
    assert {p[-2:] for p in head} == {("old_log_prob", "lm_head.forward"), ("update_actor", "lm_head.forward"),
                                      ("update_actor", "lm_head.backward")}
    assert sum(rows[p][1] for p in head if p[-1] == "lm_head.forward") == found["lm_head.forward"]
    update = ("step", "update_actor")
    assert rows[(*update, "lm_head.backward")][1] == rows[(*update, "lm_head.forward")][1] >= 2
    assert sum(rows[p][1] for p in head if p[-1] == "lm_head.backward") == found["lm_head.backward"]
    # Peak resident set per range: nested ranges never above the ranges holding them.
    for path, (_, _, rss) in rows.items():
        assert 0 < rss <= rows[path[:-1]][2] if len(path) > 1 else rss > 0, path
    # The timer's stages hold the ranges: metrics.jsonl's stage time is at least the table's.
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    for stage in ("gen", "old_log_prob", "update_actor"):
        assert metrics[f"timing_s/{stage}"] >= rows[("step", stage)][0] - 1e-3, stage
    # Profiling off: no profile directory, and the profiled run trained exactly as this one does.
    assert cli(["train", *TINY, *TWO_STEPS, "--logging.run-dir", str(plain_dir)]) == 0
    assert sorted(p.name for p in plain_dir.iterdir()) == sorted(p.name for p in run_dir.iterdir() if p.name != "profile")
    learned = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean", "response_length/mean")
    for profiled, plain in zip(*((json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines())
                                 for d in (run_dir, plain_dir)), strict=True):
        assert [profiled[k] for k in learned] == [plain[k] for k in learned]


@pytest.mark.distributed
def test_two_ranks_each_write_their_trace_and_the_lowest_prints(tmp_path):
    run_dir = tmp_path / "run"
    proc = torchrun(2, "-m", "flashdapo", "train", *TINY, *TWO_STEPS, "--logging.run-dir", str(run_dir),
                    "--profile.steps", "2")
    for rank in (0, 1):
        found = trace_ranges(run_dir / "profile" / f"rank{rank}.2.pt.trace.json")
        assert RANGES <= set(found), (rank, RANGES - set(found))
        assert (run_dir / "profile" / f"rank{rank}.2.txt").is_file()
    assert not list((run_dir / "profile").glob("*.1.*"))
    assert proc.stdout.count("flashdapo: profile of step 2, rank 0") == 1 and "rank 1\n" not in proc.stdout


def test_traced_names_forward_and_backward_and_changes_nothing():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randint(0, 11, (7,), generator=gen)
    expected = token_logprobs(h, w, y, impl="torch")
    expected.backward(torch.arange(7.0, dtype=torch.float64))
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    recorder = Recorder(torch.device("cpu"))
    with recording(recorder), named("update_actor"):
        got = traced("lm_head", lambda h, w: token_logprobs(h, w, y, impl="torch"), (h, w))
        got.backward(torch.arange(7.0, dtype=torch.float64))
    assert torch.equal(got, expected) and torch.equal(h.grad, grads[0]) and torch.equal(w.grad, grads[1])
    assert list(recorder.rows) == [("update_actor",), ("update_actor", "lm_head.forward"),
                                   ("update_actor", "lm_head.backward")]
    assert [r.calls for r in recorder.rows.values()] == [1, 1, 1]
    # Not recording: one shared null context, and the call itself (no wrapper, no copy).
    assert named("gen") is named("adv")
    result = (h * 2,)
    assert traced("lm_head", lambda h, w: result, (h, w)) is result


def test_profiling_off_makes_no_profiler_and_bad_settings_are_refused(tmp_path):
    cpu = torch.device("cpu")
    assert StepProfiler.configured(ProfileConfig(), tmp_path, 0, cpu) is None
    assert StepProfiler.configured(ProfileConfig(steps=[3], ranks=[1]), tmp_path, 0, cpu) is None
    assert StepProfiler.configured(ProfileConfig(steps=[3], ranks=[1]), tmp_path, 1, cpu).out_dir == \
        tmp_path / "profile"
    with pytest.raises(ConfigError, match=r"^profile\.steps: expected steps of the run, 1\.\.trainer\.total_steps "
                                          r"\(240\), got \[5, 241\]$"):
        merge(toy(), {"profile": {"steps": [5, 241]}})
    with pytest.raises(ConfigError, match=r"^profile\.steps: expected steps >= 1, got \[0\]$"):
        ProfileConfig(steps=[0])
    with pytest.raises(ConfigError, match=r"^profile\.ranks: rank 2 is not in a launch of 2 ranks \(0\.\.1\)"):
        check_layout(merge(toy(), {"profile": {"steps": [1], "ranks": [0, 2]}}), 2)

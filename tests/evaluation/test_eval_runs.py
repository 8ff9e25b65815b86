"""`flashdapo eval` end to end on a toy export: per-source table and files, resuming after a torn write or a
SIGKILL, 2 torchrun ranks vs 1, an AIME-2024-schema file, and the vLLM engine through its recording double."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashdapo.__main__ import main as cli
from flashdapo.config import ToyTaskConfig
from flashdapo.eval.store import EvalStoreError
from flashdapo.tasks.toy import toy_records
from tests.evaluation.toy_export import toy_export, two_source_parquet, write_parquet

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"
EVAL_ARGS = ["--k", "4", "--max-new-tokens", "6", "--max-prompt-length", "256", "--no-progress"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return toy_export(tmp_path_factory.mktemp("toy") / "export")


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    return two_source_parquet(tmp_path_factory.mktemp("data") / "two.parquet")


def samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def report(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())["report"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # the same arithmetic in every process, and two ranks on two cores
    return env


def run(cmd: list[str], expect_rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == expect_rc, f"{' '.join(cmd)}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def eval_cmd(export: Path, data: Path, out: Path, nproc: int = 0) -> list[str]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc else [sys.executable])
    return [*launcher, "-m", "flashdapo", "eval", "--model", str(export), "--data", str(data), "--out", str(out),
            *EVAL_ARGS]


def test_table_per_source_files_and_resume_after_a_torn_line(export, two_sources, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert cli(["eval", "--model", str(export), "--data", str(two_sources), "--out", str(out), *EVAL_ARGS]) == 0
    printed = capsys.readouterr().out
    assert "6 unique prompts" in printed and "| arith_a " in printed and "| arith_b " in printed
    assert "| all " in printed and "mean@4" in printed
    full, full_report = samples(out), report(out)
    assert [r["prompt_id"] for r in full] == list(range(6))
    assert {r["data_source"] for r in full} == {"arith_a", "arith_b"}
    first = full[0]["samples"][0]
    assert set(first) == {"response", "pred", "score", "acc", "length", "finish_reason"}
    assert len(full[0]["samples"]) == 4 and first["finish_reason"] in ("stop", "length")
    assert [s["source"] for s in full_report["sources"]] == ["arith_a", "arith_b"]
    assert len(full_report["pooled"]["pass_at"]) == 4  # every k up to n

    # Keep two prompts and half of a third line: the rerun drops the torn line and does the rest again.
    lines = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    (out / "samples.jsonl").write_text("".join(lines[:2]) + lines[2][:25])
    assert cli(["eval", "--model", str(export), "--data", str(two_sources), "--out", str(out), *EVAL_ARGS]) == 0
    printed = capsys.readouterr()
    assert "resuming, 2 of 6" in printed.out
    # The warning is one line of the command line's (warning_lines.py), not Python's two.
    assert [line for line in printed.err.splitlines() if "incomplete last line" in line] == [
        f"flashdapo: warning: {out / 'samples.jsonl'}: dropping an incomplete last line (25 bytes, an interrupted "
        "write); its prompt is evaluated again"]
    assert samples(out) == full and report(out) == full_report

    # Other settings into the same OUT: one line naming the setting, before the model loads.
    assert cli(["eval", "--model", str(export), "--data", str(two_sources), "--out", str(out), "--k", "2",
                "--max-new-tokens", "6", "--max-prompt-length", "256", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "eval_settings.json: k was 4, this evaluation has 2" in err and "Traceback" not in err, err
    monkeypatch.setenv("FLASHDAPO_DEBUG", "0")  # --debug sets it for the process: restored after the test
    with pytest.raises(EvalStoreError, match="k was 4"):  # the traceback on request
        cli(["--debug", "eval", "--model", str(export), "--data", str(two_sources), "--out", str(out), "--k", "2",
             "--max-new-tokens", "6", "--max-prompt-length", "256", "--no-progress"])


def test_out_that_is_a_file_or_in_use_is_refused_in_one_line(export, two_sources, tmp_path, capsys):
    a_file = tmp_path / "out.txt"
    a_file.write_text("not a directory")
    assert cli(["eval", "--model", str(export), "--data", str(two_sources), "--out", str(a_file), *EVAL_ARGS]) == 1
    err = capsys.readouterr().err
    assert f"--out {a_file} is a file, not a directory" in err and "Traceback" not in err, err

    out = tmp_path / "busy"
    out.mkdir()
    with open(out / ".flashdapo-eval.lock", "a") as held:  # another evaluation holds OUT
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert cli(["eval", "--model", str(export), "--data", str(two_sources), "--out", str(out), *EVAL_ARGS]) == 1
    assert "is in use by another evaluation" in capsys.readouterr().err
    assert not (out / "samples.jsonl").exists()
    # Released (here by closing; a dead process's lock goes with it): the evaluation runs, then releases it.
    assert cli(["eval", "--model", str(export), "--data", str(two_sources), "--out", str(out), *EVAL_ARGS]) == 0
    assert len(samples(out)) == 6


def test_a_problem_in_two_files_counts_under_both_sources(export, tmp_path, capsys):
    records = toy_records(ToyTaskConfig(num_val=3), "val")
    rows = lambda source, recs: [{"data_source": source, "prompt": r.messages, "ability": "MATH",  # noqa: E731
                                  "reward_model": {"ground_truth": r.ground_truth, "style": "rule"}} for r in recs]
    first = write_parquet(tmp_path / "a.parquet", rows("set_a", records) * 2)  # each file repeats its problems
    second = write_parquet(tmp_path / "b.parquet", rows("set_b", records[1:]))  # two of them shared with a
    out = tmp_path / "out"
    assert cli(["eval", "--model", str(export), "--data", str(first), str(second), "--out", str(out), *EVAL_ARGS]) == 0
    sources = {s["source"]: s["prompts"] for s in report(out)["sources"]}
    assert sources == {"set_a": 3, "set_b": 2}, sources


@pytest.mark.slow
def test_sigkill_mid_eval_then_rerun_reports_the_uninterrupted_metrics(export, two_sources, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(eval_cmd(export, two_sources, straight))
    args = ["--model", str(export), "--data", str(two_sources), "--out", str(killed), *EVAL_ARGS]
    run([sys.executable, str(SCRIPTS / "kill_eval.py"), "4", *args], expect_rc=-9)
    assert len(samples_or_torn(killed)) == 3  # three whole prompts, the fourth torn
    proc = run(eval_cmd(export, two_sources, killed))
    assert "incomplete last line" in proc.stderr and "resuming, 3 of 6" in proc.stdout
    got = samples(killed)
    assert sorted(r["prompt_id"] for r in got) == list(range(6))  # each prompt exactly once
    assert got == samples(straight) and report(killed) == report(straight)


def samples_or_torn(out: Path) -> list[str]:
    text = (out / "samples.jsonl").read_text()
    assert not text.endswith("\n")
    return text.split("\n")[:-1]


@pytest.mark.distributed
def test_two_ranks_equal_one_rank_and_fsdp_shards_sample_as_the_replica(export, two_sources, tmp_path):
    one, two, sharded = tmp_path / "one", tmp_path / "two", tmp_path / "fsdp"
    run(eval_cmd(export, two_sources, one, nproc=1))
    proc = run(eval_cmd(export, two_sources, two, nproc=2))
    assert "2 rank(s)" in proc.stdout
    assert samples(two) == samples(one) and report(two) == report(one)
    # FSDP2 over 2 ranks: rank 0 (even prompt ids) draws the replica's tokens from the sharded weights;
    # rank 1 seeds its generator with its rank, so its prompts get other samples.
    run([*eval_cmd(export, two_sources, sharded, nproc=2), "--fsdp"])
    got, want = samples(sharded), samples(one)
    assert [r["prompt_id"] for r in got] == list(range(6))
    assert got[0::2] == want[0::2] and got[1::2] != want[1::2]


def test_public_aime_2024_file_dedups_to_30_prompts_under_one_source_named_by_its_file(export, tmp_path):
    """The public AIME-2024 parquet (30 problems x 32 copies) end to end on the toy export."""
    path = Path(__file__).parents[1] / "data" / "aime-2024.parquet"
    out = tmp_path / "out"
    assert cli(["eval", "--model", str(export), "--data", str(path), "--out", str(out), "--k", "2",
                "--max-new-tokens", "3", "--max-prompt-length", "48", "--prompts-per-call", "8", "--sources", "file", "--no-progress"]) == 0
    result = report(out)
    # Its data_source column says math_dapo (as the training set's does): --sources file names it by its file.
    assert [s["source"] for s in result["sources"]] == ["aime-2024"] and result["pooled"]["prompts"] == 30
    assert len(samples(out)) == 30 and result["pooled"]["mean"] == 0.0


def test_vllm_engine_through_the_recording_double(export, two_sources, tmp_path):
    from flashdapo.config import DataConfig
    from flashdapo.data import load_prompts
    from flashdapo.distributed.mesh import init_distributed, shutdown
    from flashdapo.eval.command import eval_engine
    from flashdapo.eval.sampling import EvalSampling, sample_prompts
    from flashdapo.reward import dapo_verify
    from flashdapo.tokenizer import load_tokenizer
    from tests.helpers.vllm_double import FAKE_VLLM

    args = SimpleNamespace(engine="vllm", model=str(export), tensor_parallel_size=1, max_prompt_length=64,
                           max_new_tokens=6, seed=3)
    env = init_distributed("cpu")
    try:
        tokenizer = load_tokenizer(str(export))
        engine = eval_engine(args, env, tokenizer, vllm_module=FAKE_VLLM)  # the stop ids come from the tokenizer
        prompts = load_prompts([str(two_sources)], tokenizer, DataConfig(dedup=True)).prompts
        results = sample_prompts(engine, prompts, tokenizer, dapo_verify, EvalSampling(k=3, max_new_tokens=6,
                                                                                        prompts_per_call=4))
    finally:
        shutdown()
    init = engine.llm.init_kwargs
    assert init["model"] == str(export) and "load_format" not in init and init["max_model_len"] == 70
    generates = [c for c in engine.llm.calls if c[0] == "generate"]
    assert [len(c[1]) for c in generates] == [4, 2]  # two rounds of one call each
    assert all(sp.n == 3 and sp.top_p == 0.7 for c in generates for sp in c[2])
    assert [r.prompt_id for r in results] == list(range(6)) and all(len(r.samples) == 3 for r in results)
    truncated = [s.finish_reason == "length" for r in results for s in r.samples]
    assert all(s.length == 6 for r in results for s in r.samples if s.finish_reason == "length") and any(truncated)

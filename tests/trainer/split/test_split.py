"""Split placement (rollout.placement=split) over real gloo ranks, torch engine: k = 0 equals the co-located run
bitwise (rounds, and streaming with dynamic sampling and groups rolling over), k = 1 and k = 2 repeat bitwise
run to run, and every trained token's lag is the schedule's exactly."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from flashdapo.trainer.split.schedule import expected_lag, last_pushed_step, weights_step
from tests.helpers.runs import ROOT, TINY, subprocess_env

SPLIT = ["--rollout.placement", "split", "--rollout.rollout-ranks", "1"]
STEPS = ["--trainer.total-steps", "3"]
# Dynamic sampling on the shaped score (the overlong penalty makes most of the tiny toy's groups informative):
# more informative groups than train_batch, so some roll over into the next batch.
DS = ["--algorithm.filter-metric", "score", "--rollout.max-response-length", "24", "--algorithm.dynamic-sampling",
      "True", "--algorithm.max-gen-batches", "0", "--trainer.gen-batch", "8"]
TIMING = ("timing_s/", "perf/")
SPLIT_TIMING = ("split/trainer_idle", "split/rollout_idle", "split/weight_push_s", "split/batch_transfer_s",
                "split/staged_max")


def _start(nproc: int, run_dir, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "flashdapo", "train", *TINY, *STEPS, *args, "--logging.run-dir", str(run_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env(),
                            cwd=ROOT)


def _together(*runs: tuple) -> None:
    """Start the runs at once (1 thread per rank), wait for all; each must succeed."""
    procs = [_start(*run) for run in runs]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-5000:]


def _rows(run_dir, drop=TIMING):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


def _export(run_dir) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "export" / "model.safetensors")


def test_the_schedule():
    # k = 1: batch b samples θ_(b-2); the first batch the start's.
    assert [weights_step(b, 1) for b in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [expected_lag(s, 1) for s in range(1, 6)] == [0, 1, 1, 1, 1]
    assert [expected_lag(s, 0) for s in range(1, 4)] == [0, 0, 0]
    assert [expected_lag(s, 2) for s in range(1, 6)] == [0, 1, 2, 2, 2]
    assert last_pushed_step(10, 2) == 7 and last_pushed_step(1, 2) == 0


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("collector", ["rounds", "streaming"])
def test_lag_zero_equals_the_colocated_run_bitwise(tmp_path, collector):
    """1 trainer + 1 rollout rank at k = 0 against one co-located rank: the same metrics (validation included)
    and the same exported weights, bit for bit. Streaming runs with dynamic sampling, so informative groups past
    the target roll into the next batch on both sides."""
    extra = [] if collector == "rounds" else [*DS, "--rollout.streaming", "True"]
    _together((2, tmp_path / "split", *extra, *SPLIT, "--rollout.max-lag", "0"), (1, tmp_path / "co", *extra))
    split = _rows(tmp_path / "split", TIMING + ("split/",))
    co = _rows(tmp_path / "co")
    assert len(co) == 3 and split == co
    assert any(k.startswith("val/") for k in co[-1])
    a, b = _export(tmp_path / "split"), _export(tmp_path / "co")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    lags = _rows(tmp_path / "split")
    if collector == "rounds":  # every token sampled by the weights it trains
        assert all(r["split/lag_max"] == 0 and r["split/lag_hist_0"] == r["split/trained_tokens"] > 0 for r in lags)
    else:  # groups kept past a target and carried responses are older: the co-located stream's own lags
        assert any(r["split/lag_max"] > 0 for r in lags)
        assert [(r["split/lag_mean"], r["split/lag_max"]) for r in lags] == [
            (r["stream/lag_mean"], r["stream/lag_max"]) for r in co]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("k", "ranks"), [(1, 3), (2, 2)])
def test_every_trained_token_has_the_schedules_lag_and_runs_repeat(tmp_path, k, ranks):
    """Dynamic sampling off: every trained token of step s was sampled by θ_(s-1-k) (the start's while
    s-1-k < 0): its lag is exactly min(k, s-1). Two runs of the same seed are identical, bit for bit."""
    lag = ["--rollout.max-lag", str(k), "--trainer.total-steps", "4"]
    _together((ranks, tmp_path / "a", *SPLIT, *lag), (ranks, tmp_path / "b", *SPLIT, *lag))
    a, b = _rows(tmp_path / "a", TIMING + SPLIT_TIMING), _rows(tmp_path / "b", TIMING + SPLIT_TIMING)
    assert len(a) == 4 and a == b
    assert all(torch.equal(x, y) for x, y in zip(_export(tmp_path / "a").values(), _export(tmp_path / "b").values()))
    responses = 4 * 4  # train_batch x n
    for row in a:
        s = int(row["step"])
        want = expected_lag(s, k)
        assert row["split/weights_step"] == weights_step(s, k)
        assert row["split/lag_min"] == row["split/lag_max"] == row["split/lag_mean"] == want, row
        assert row[f"split/lag_hist_{want}"] == row["split/trained_tokens"]
        assert row["split/trained_tokens"] == pytest.approx(row["response_length/mean"] * responses)
        assert row["split/older_responses"] == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_dynamic_sampling_rolls_groups_over_with_their_own_lag(tmp_path):
    """Rounds with dynamic sampling at k = 1: informative groups past train_batch open the next batch (older
    than the schedule's), every token's lag is that of the batch that sampled it, and the run repeats."""
    args = [*DS, *SPLIT, "--rollout.max-lag", "1", "--trainer.total-steps", "4"]
    _together((2, tmp_path / "a", *args), (2, tmp_path / "b", *args))
    a, b = _rows(tmp_path / "a", TIMING + SPLIT_TIMING), _rows(tmp_path / "b", TIMING + SPLIT_TIMING)
    assert a == b
    assert any(r["split/older_responses"] > 0 for r in a), "no group rolled over: the test shows nothing"
    for row in a:
        s = int(row["step"])
        allowed = {s - 1 - weights_step(b0, 1) for b0 in range(1, s + 1)}
        seen = {j for j in range(4) if row[f"split/lag_hist_{j}"] > 0}
        assert seen <= allowed and row["split/lag_min"] >= expected_lag(s, 1), row


@pytest.mark.distributed
def test_the_push_check_names_a_perturbed_tied_head(tmp_path):
    """The rollout side's copy of the weights differs from what the trainer pushed (the tied embedding / LM
    head, after the second load): the push check stops the job in one line naming that tensor."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "trainer" / "scripts" / "split_perturb_push.py"), "1", *TINY, *STEPS, *SPLIT,
           "--rollout.max-lag", "0", "--logging.run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=300)
    assert proc.returncode != 0
    line = next((x for x in proc.stderr.splitlines() if "after loading the weights of step 1" in x), "")
    assert "tensors that differ: model.embed_tokens.weight" in line, proc.stderr[-3000:]
    assert "(rank 1 (rollout rank 0); stopping every rank)" in line


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_at_lag_zero_equals_the_colocated_lora_run_bitwise_pushing_only_the_adapters(tmp_path):
    """LoRA: the rollout side builds the same frozen base, so a version carries the adapters (and the norms
    trained whole) alone, and k = 0 still equals the co-located run bit for bit (metrics and the exported
    adapters)."""
    lora = ["--lora.rank", "4"]
    _together((2, tmp_path / "split", *lora, *SPLIT, "--rollout.max-lag", "0"), (1, tmp_path / "co", *lora))
    split, co = _rows(tmp_path / "split", TIMING + ("split/",)), _rows(tmp_path / "co")
    assert len(co) == 3 and split == co
    a, b = (load_file(tmp_path / run / "export" / "adapter_model.safetensors") for run in ("split", "co"))
    assert len(a) == 28 + 5 and a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    # what each version carried: the 28 fp32 adapters' and the 5 norms' bytes, not the model's
    adapter_bytes = sum(t.numel() * 4 for t in a.values())
    pushed = [r["split/weight_push_bytes"] for r in _rows(tmp_path / "split")]
    assert pushed[:-1] == [float(adapter_bytes)] * 2 and pushed[-1] == 0  # the last step has no later batch

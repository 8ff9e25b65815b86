"""Ulysses sequence parallelism and micro-batches that keep ranks in step, over real gloo ranks: sp=2 trains
as one rank does, ranks with skewed shares run as many micro-batches as each other, the training command
runs and resumes bitwise under sp=2, attention with fewer KV heads than ranks, a sliding window or flash-attn's
varlen kernel (a CPU stand-in) gives one process's result, and settings that cannot work are one line."""

import json
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.runs import ROOT, TINY, TRAINER_SCRIPTS, run_metrics, subprocess_env, torchrun
from tests.helpers.thread_ranks import ThreadGroup

MODES = ("token-mean", "seq-mean-token-mean")


def _run(tmp_path, name: str, ranks: int, budget: int, sp: int):
    (tmp_path / name).mkdir()
    torchrun(ranks, str(TRAINER_SCRIPTS / "sequence_parallel_update.py"), str(tmp_path / name), str(budget), str(sp))
    return tmp_path / name


@pytest.mark.distributed
@pytest.mark.slow
def test_sequence_parallel_and_skewed_ranks_train_as_one_rank(tmp_path):
    """One rank (sp=1, budget 128) vs 2 ranks at sp=2 (budget 64 per rank: the same micro-batches, each rank
    holding half of each; the 150-token response is longer than a shard) vs 2 data-parallel ranks (budget 32:
    one rank's share needs more micro-batches than the other's). A 60-token prompt leaves one sp shard with
    no response token to predict. Same old
    log-probs, losses, gradient norms and parameters, in float64 (the LM-head log-probs are fp32: tolerances
    1e-6 relative on losses and norms, 1e-5 of each tensor's norm on the parameters after 4 AdamW steps).
    And both at once: 4 ranks, 2 data-parallel slots x sp=2, the responses dealt to the slots by tokens."""
    one, sp2, dp2 = _run(tmp_path, "one", 1, 128, 1), _run(tmp_path, "sp2", 2, 64, 2), _run(tmp_path, "dp2", 2, 32, 1)
    dp2sp2 = _run(tmp_path, "dp2sp2", 4, 64, 2)
    initial = torch.load(one / "initial.pt")
    for mode in MODES:
        ref = json.loads((one / f"sp_{mode}.json").read_text())
        assert len(ref["pg_loss"]) == 4 and ref["micro_batches"][0] > 1, mode
        ref_old = json.loads((one / f"rank0_{mode}.json").read_text())["old_logprobs"]
        for run, ranks in ((sp2, 2), (dp2, 2), (dp2sp2, 4)):
            got = json.loads((run / f"sp_{mode}.json").read_text())
            for key in ("pg_loss", "grad_norm"):
                torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), rtol=1e-6, atol=1e-9)
            # Every response's old log-probs, from the rank it was dealt to, equal one rank's.
            dealt = {}
            for r in range(ranks):
                dealt.update(json.loads((run / f"rank{r}_{mode}.json").read_text())["old_logprobs"])
            assert dealt.keys() == ref_old.keys(), (run.name, mode)
            for key, values in dealt.items():
                torch.testing.assert_close(torch.tensor(values), torch.tensor(ref_old[key]), rtol=1e-6, atol=1e-6)
            expected, params = torch.load(one / f"params_{mode}.pt"), torch.load(run / f"params_{mode}.pt")
            for name in expected:
                assert (params[name] - expected[name]).norm() <= 1e-5 * expected[name].norm(), (mode, name)
        assert all((initial[n] - expected[n]).abs().max() > 1e-3 for n in expected if "norm" not in n), mode
        ranks = [json.loads((run / f"rank{r}_{mode}.json").read_text()) for run in (sp2, dp2) for r in (0, 1)]
        sp_ranks, dp_ranks = ranks[:2], ranks[2:]
        assert sp_ranks[0]["micro_batches"] == sp_ranks[1]["micro_batches"] == ref["micro_batches"]
        # Some shard held only prompt tokens: that rank still ran the group's all-to-alls in backward.
        assert sp_ranks[0]["shards_without_targets"] > 0
        # The data-parallel ranks' shares needed different numbers of micro-batches, and they ran the same
        # number (the agreed maximum): with their own counts the rank with fewer would leave the other waiting
        # forever in an FSDP2 collective of its extra micro-batch.
        assert dp_ranks[0]["micro_batches"] == dp_ranks[1]["micro_batches"]
        assert dp_ranks[0]["needed"] != dp_ranks[1]["needed"]
        assert [max(a, b) for a, b in zip(dp_ranks[0]["needed"], dp_ranks[1]["needed"])] == dp_ranks[0]["micro_batches"]


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_attention_under_sequence_parallel_equals_one_process(tmp_path, ranks):
    """sp = 2 (and 4) ranks vs one process with padded rows and HF's own masks, on one micro-batch whose
    longest sequence spans the shards: 4 query heads with 1 KV head (repeated to each rank), a sliding window
    of 6 in layer 1, and both through flash-attn's varlen function (the stand-in, bf16). float64: the same
    log-probs and gradients to rounding; bf16: no further from the float64 reference than HF's padded SDPA in
    bf16 is."""
    torchrun(ranks, str(TRAINER_SCRIPTS / "sequence_parallel_attention.py"), str(tmp_path))
    results = torch.load(tmp_path / "results.pt")
    for name in ("kv1", "window"):
        (logp, grads), (ref_logp, ref_grads) = results[name]["sp"], results[name]["padded"]
        torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-12, msg=name)
        for n in ref_grads:
            assert (grads[n] - ref_grads[n]).norm() <= 1e-12 * ref_grads[n].norm(), (name, n)
    flash = results["flash"]
    assert flash["flash_calls"] == [(-1, -1), (5, 0)]  # layer 0 full, layer 1 the window of 6
    err, bf16_err = _error(flash["sp"], flash["padded"]), _error(flash["padded_bf16"], flash["padded"])
    assert err[0] <= 2 * bf16_err[0] and err[1] <= 2 * bf16_err[1], (err, bf16_err)


def _error(got, reference):
    """(max |log-prob error|, the largest relative gradient error over the parameters)."""
    (logp, grads), (ref_logp, ref_grads) = got, reference
    return (logp - ref_logp).abs().max().item(), max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item()
                                                     for n in ref_grads)


@pytest.mark.parametrize("heads, kv_heads, sp, window", [(4, 1, 4, None), (8, 1, 8, 5), (16, 2, 4, None),
                                                         (32, 4, 8, 7), (8, 8, 4, None), (8, 2, 2, None)])
def test_ulysses_attention_head_mapping_without_ranks(monkeypatch, heads, kv_heads, sp, window):
    """The packed attention under sequence parallelism (its KV-head repeat and both all-to-alls) with sp ranks
    simulated by threads: each rank's output shard is that of attention on the whole row in one process, also
    where the ranks outnumber the KV heads (Qwen2.5-3B's 16 and 2 at sp = 4, Qwen3-30B-A3B's 32 and 4 at 8)."""
    from flashdapo.models import packing, ulysses

    ulysses.check_heads(heads, kv_heads, sp)
    group = ThreadGroup(sp)
    rank_of = {}
    monkeypatch.setattr(ulysses.dist, "get_world_size", lambda g: sp)
    monkeypatch.setattr(ulysses, "_all_to_all",
                        lambda chunks, g: group.all_to_all(chunks, rank_of[threading.get_ident()]))
    g = torch.Generator().manual_seed(heads + sp)
    offsets, total = (0, 5, 30, 31, 48), 48
    query = torch.randn(1, heads, total, 4, generator=g, dtype=torch.float64)
    key, value = (torch.randn(1, kv_heads, total, 4, generator=g, dtype=torch.float64) for _ in range(2))
    bounds = packing.DocumentBounds.from_lengths([b - a for a, b in zip(offsets[:-1], offsets[1:])], "cpu")
    expected = packing.document_attention(query, key, value, offsets, None, window)
    shards: dict[int, torch.Tensor] = {}

    def rank(r: int):
        rank_of[threading.get_ident()] = r
        a, b = ulysses.shard_bounds(total, sp, r)
        shards[r] = packing._attend_packed(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], "sdpa", bounds,
                                           object(), sliding_window=window)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(sp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat([shards[r] for r in range(sp)], dim=1), expected, rtol=1e-12, atol=1e-12)


SKEWED = ["--model.toy.sft-steps", "60", "--rollout.max-response-length", "48", "--trainer.micro-batch-tokens", "40",
          "--algorithm.dynamic-sampling", "True", "--algorithm.max-gen-batches", "4",
          "--algorithm.on-max-gen-batches", "continue", "--trainer.gen-batch", "8"]


@pytest.mark.distributed
@pytest.mark.slow
def test_train_command_under_sequence_parallel_resumes_bitwise(tmp_path):
    """`flashdapo train --trainer.sequence-parallel 2` on 2 ranks: a briefly warmed-up toy model (responses of
    a few to tens of tokens), dynamic sampling (training on what 4 rounds find), a 40-token budget per rank;
    4 steps straight vs 2 steps then a resume."""
    common = [*TINY, *SKEWED, "--trainer.sequence-parallel", "2", "--checkpoint.save-every", "2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    torchrun(2, "-m", "flashdapo", "train", *common, "--trainer.total-steps", "4", "--logging.run-dir", str(straight))
    torchrun(2, "-m", "flashdapo", "train", *common, "--trainer.total-steps", "2", "--logging.run-dir", str(resumed))
    torchrun(2, "-m", "flashdapo", "train", *common, "--trainer.total-steps", "4", "--logging.run-dir", str(resumed),
             "--checkpoint.resume", "auto")
    rows = run_metrics(straight)
    # The 2-step run validated at its last step (step 2); the straight run did not: compare the rest.
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and _without_val(run_metrics(resumed)) == _without_val(rows)
    trained = [r for r in rows if "actor/grad_norm" in r]
    for r in rows:  # each group counted once, not once per rank of its sequence-parallel group
        informative = round(r["train/kept_fraction"] * r["train/num_gen_batches"] * 8)
        assert r["train/kept_groups"] == min(informative, 4), r
    assert len(trained) >= 2 and all(r["actor/grad_norm"] > 0 for r in trained)
    assert max(r["response_length/max"] for r in trained) > 3 * min(r["response_length/min"] for r in trained)
    final_a, final_b = (load_file(d / "export" / "model.safetensors") for d in (straight, resumed))
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def _without_val(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("val/")} for r in rows]


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The one-line user errors (`flashdapo: error: ...`, `flashdapo: config error: ...`) in a run's output."""
    return [line for line in (proc.stdout + proc.stderr).splitlines()
            if line.startswith("flashdapo: ") and "error: " in line]


@pytest.mark.distributed
def test_sequence_parallel_that_cannot_work_is_one_line(tmp_path):
    run = ["-m", "flashdapo", "train", *TINY, "--logging.run-dir", str(tmp_path / "run")]
    env = {**subprocess_env(), "FLASHDAPO_DEBUG": "0"}
    alone = subprocess.run([sys.executable, *run, "--trainer.sequence-parallel", "2"], capture_output=True,
                           text=True, env=env, cwd=ROOT, timeout=300)
    lines = _error_lines(alone)
    assert alone.returncode != 0 and len(lines) == 1 and "divide the world size 1" in lines[0], alone.stderr[-2000:]
    # 3 KV heads neither divide by 2 nor divide 2 (1 KV head would be repeated, and runs).
    heads = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            *run, "--trainer.sequence-parallel", "2", "--model.toy.hidden-size", "48",
                            "--model.toy.num-heads", "6", "--model.toy.num-kv-heads", "3"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    lines = _error_lines(heads)
    assert heads.returncode != 0 and len(lines) == 1, heads.stderr[-3000:]
    assert "6 query heads and 3 key/value heads" in lines[0] and "choose one of 1, 3, 6" in lines[0], lines[0]

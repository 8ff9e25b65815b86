"""bench/bench_moe.py --smoke end to end: a tiny Qwen3-MoE trained at E = 1 and E = 2 on 2 gloo ranks (one torchrun
launch) and the torch engine's log-probs against the trainer's with routing replay off and r3. Checks that can
fail: every row of both tables is written (no memory row: the smoke runs both arms in one launch); E = 2 trains
to the same losses as E = 1 on the same batch; the all-to-all bytes counted at the collective are zero at E = 1,
and at E = 2 the backward's sum over ranks equals the forward's (the gradients go back the way the rows came) and
the total is near the even-routing formula; under r3 every expert the trainer computes with is the engine's
(agreement 1.0), while the bf16 engine's routes differ from the fp32 trainer's own somewhere; the fp32 torch
engine's log-probs are the trainer's to float noise. Wall budget: 30 s (measured 12-22 s on the loaded 2-core
machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `bench` is a top-level folder, not installed

from bench import bench_moe  # noqa: E402


def test_formula_counts_dispatch_and_combine_forward_and_backward():
    # 2 layers x 10 tokens x top-2 x hidden 4 x 4 bytes x 1/2 off-rank x 2 (dispatch + combine) x 2 (fwd + bwd)
    assert bench_moe.formula_bytes(10, 2, 4, 4, ep=2, layers=2) == 2 * 10 * 2 * 4 * 4 * 0.5 * 2 * 2
    assert bench_moe.formula_bytes(10, 2, 4, 4, ep=1, layers=2) == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_smoke_writes_both_tables_with_equal_losses_and_full_agreement_under_r3(tmp_path):
    out = tmp_path / "moe.md"
    assert bench_moe.main(["--smoke", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    text = out.read_text()
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
             if line.startswith("| ") and not line.startswith(("| figure", "| engine"))]
    rows = {c[0]: c for c in cells}
    paired_time = bench_moe.TIME_ROWS[0]
    assert bench_moe.MEMORY_ROW not in rows  # a launch of both arms: no arm's own peak memory
    for name in (paired_time, "all-to-all MB sent per rank per step, measured",
                 "all-to-all MB per rank per step, formula", "pg_loss max abs(E - E1) over steps",
                 "measured / formula"):
        assert name in rows, (name, text)
    assert float(rows[paired_time][1]) > 0 and float(rows[paired_time][2]) > 0 and float(rows[paired_time][3]) > 0

    data = json.loads((tmp_path / "work" / "moe.json").read_text())
    (record,) = data["steps"]
    e1, e2 = record["paired"]["1"], record["paired"]["2"]
    assert len(e1["losses"]) == len(e2["losses"]) == 3  # warm-up + 2 timed steps
    for a, b in zip(e1["losses"], e2["losses"], strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    assert all(r["forward_bytes"] == r["backward_bytes"] == 0 for r in e1["ranks"])
    forward = sum(r["forward_bytes"] for r in e2["ranks"])
    assert forward > 0 and sum(r["backward_bytes"] for r in e2["ranks"]) == forward
    measured = forward * 2
    assert 0.5 < measured / sum(e2["formula_bytes"]) < 1.5

    mismatch = {(r["engine"], r["replay"]): r for r in data["mismatch"]}
    assert set(mismatch) == {(e, m) for e in ("torch", "torch-bf16") for m in ("off", "r3")}
    for engine in ("torch", "torch-bf16"):
        assert mismatch[(engine, "r3")]["used_agreement"] == 1.0
        assert mismatch[(engine, "off")]["used_agreement"] == mismatch[(engine, "off")]["own_agreement"]
    assert mismatch[("torch", "off")]["max_gap"] < 1e-4
    # the premise of the r3 check: the bf16 engine routed some positions otherwise than the fp32 trainer would
    assert mismatch[("torch-bf16", "off")]["used_agreement"] < 1.0, "no route to replay: the smoke proves nothing"

"""A tiny Qwen3-MoE trained with its routers' load-balancing loss: the term joins the update's loss exactly
(coefficient c vs 0: losses differ by c x the router loss), 2 FSDP2 ranks (padded rows) and a
sequence-parallel pair (packed, activation checkpointing) update as 1 rank does (losses, router losses,
grad norms, expert load, parameters), and `flashdapo train --model.path` trains 2 steps on one and logs the
router metrics."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.moe import fixed_batch_update, moe_model_dir
from tests.helpers.runs import TRAINER_SCRIPTS, torchrun, train_two_steps_on


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    """The 1-rank reference, in this process (coefficient 0.5, packed)."""
    out = tmp_path_factory.mktemp("one_rank")
    fixed_batch_update(out, "packed")
    return out


def _read(out: Path) -> tuple[dict, dict]:
    return json.loads((out / "moe.json").read_text()), torch.load(out / "params.pt")


def _assert_same_update(ref: Path, other: Path) -> None:
    (a, pa), (b, pb) = _read(ref), _read(other)
    assert len(a["loss"]) == 4 and len(a["aux"]) == 4
    for key in ("pg_loss", "loss", "aux", "grad_norm", "load"):
        torch.testing.assert_close(torch.tensor(b[key]), torch.tensor(a[key]), rtol=1e-6, atol=1e-9, msg=key)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert (pb[name] - pa[name]).norm() <= 1e-6 * pa[name].norm(), name


def test_the_router_term_joins_the_loss_with_its_coefficient(one_rank, tmp_path):
    fixed_batch_update(tmp_path, "packed", coef=0.0)
    (on, p_on), (off, p_off) = _read(one_rank), _read(tmp_path)
    # First optimizer step: the same weights, so the same policy loss and router loss; the loss backpropagated
    # differs by exactly 0.5 x the router loss (0: not at all).
    assert on["pg_loss"][0] == off["pg_loss"][0] and on["aux"][0] == off["aux"][0] > 0
    assert on["loss"][0] - off["loss"][0] == pytest.approx(0.5 * on["aux"][0], rel=1e-12)
    assert off["loss"] == off["pg_loss"]
    assert on["grad_norm"][0] != pytest.approx(off["grad_norm"][0], rel=1e-3)  # it reached the gradient
    assert all((p_on[n] - p_off[n]).abs().max() > 1e-6 for n in p_on if "gate.weight" in n)


@pytest.mark.distributed
def test_two_ranks_padded_update_as_one_rank_packed(one_rank, tmp_path):
    torchrun(2, str(TRAINER_SCRIPTS / "moe_update.py"), str(tmp_path), "padded", "1")
    _assert_same_update(one_rank, tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_sequence_parallel_pair_updates_as_one_rank(one_rank, tmp_path):
    """With activation checkpointing: transformers records the router logits in the forward, not again when
    backward recomputes the blocks."""
    torchrun(2, str(TRAINER_SCRIPTS / "moe_update.py"), str(tmp_path), "packed", "2", "checkpointing")
    _assert_same_update(one_rank, tmp_path)


def test_train_on_a_moe_model_dir_logs_the_router_loss_and_expert_load(tmp_path, capsys):
    """config.json's output_router_logits on: its coefficient (0.01) trains, and the torch engine samples."""
    model = moe_model_dir(tmp_path / "model", output_router_logits=True)
    run, rows = train_two_steps_on(model, tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["actor/router_aux_loss"] > 0
        layers = [row[f"moe/expert_load_max_over_mean/layer_{i}"] for i in (0, 1)]
        assert all(1.0 <= v <= 2.0 for v in layers)  # max / mean of 4 experts picked 2 at a time: at most 4 / 2
        assert row["moe/expert_load_max_over_mean"] == pytest.approx(sum(layers) / 2)

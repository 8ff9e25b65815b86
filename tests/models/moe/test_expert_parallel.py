"""Expert parallelism (trainer.expert_parallel, flashdapo/models/moe/expert_parallel.py) over real gloo ranks:
the all-to-all dispatch computes what HF's experts module computes, forward and backward; a tiny Qwen3-MoE
trains at E = 2 on 2 ranks as at E = 1 on 2 ranks and on 1 rank; checkpoints and the HF state reshard across
E and world sizes; settings that cannot work are one line."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from flashdapo.config import merge, toy
from flashdapo.distributed.mesh import DistEnv, ExpertParallelError, expert_parallel_mesh
from flashdapo.errors import ConfigError
from flashdapo.models.moe.expert_parallel import check_expert_parallel, expert_modules
from flashdapo.preflight import check_batch_layout
from tests.helpers.moe import tiny_moe
from tests.helpers.runs import ROOT, torchrun

SCRIPT = ROOT / "tests" / "models" / "moe" / "scripts" / "expert_parallel_runs.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The two launches every distributed test here reads (tests/models/moe/scripts/expert_parallel_runs.py):
    2 ranks (the dispatch cases; training at E = 1 and E = 2; their checkpoints; E = 1's loaded at E = 2; the
    trainer's loader at E = 2), then 1 rank (training; E = 2's checkpoint loaded)."""
    out = tmp_path_factory.mktemp("expert_parallel")
    (out / "two.log").write_text(torchrun(2, str(SCRIPT), str(out), "two").stderr)
    torchrun(1, str(SCRIPT), str(out), "one")
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_dispatch_equals_the_whole_experts_module(runs):
    """E = 2, random routings (expert 3 never chosen; no token for rank 1's experts; a rank with no token of
    its own): each rank's output and its hidden-state and routing-weight gradients equal HF's forward of the
    whole module on its tokens, and its experts' gradients the sum of both ranks' (float64, to rounding).
    Rank r holds experts 2r and 2r + 1."""
    results = torch.load(runs / "dispatch.pt")
    assert results.pop("held") == [[0, 1], [2, 3]]
    assert len(results) == 4
    for case, ranks in results.items():
        for rank, diffs in enumerate(ranks):
            assert diffs.pop("expert grads norm") > 1.0, case  # the gradients compared are not all zero
            for what, diff in diffs.items():
                assert diff < 1e-12, (case, rank, what, diff)


def _dump(run: Path, name: str) -> tuple[dict, dict]:
    return json.loads((run / f"{name}.json").read_text()), torch.load(run / f"{name}.pt")


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_trains_as_one_rank(runs):
    """One fixed batch, 4 AdamW steps (2 off-policy), float64 model (the LM head's log-probs are fp32: 1e-6
    relative on losses and norms, 1e-6 of each tensor's norm on the parameters): E = 2 on 2 ranks (experts
    on the ("efsdp", "ep") mesh, 2 of the 4 per rank) gives E = 1 on 2 ranks' and 1 rank's old log-probs,
    losses, gradient norms and parameters; the gathered state holds whole [4, ...] expert tensors."""
    (one, one_state), (e1, e1_state), (e2, e2_state) = (_dump(runs, n) for n in ("one", "e1", "e2"))
    assert e2["layout"] == [{"mesh": ["efsdp", "ep"], "rows": 2}] * 2
    assert e1["layout"] == [{"mesh": ["dp"], "rows": 2}] * 2 and one["layout"] == [{"mesh": ["dp"], "rows": 4}]
    assert len(one["pg_loss"]) == 4
    params = [k for k in one_state if k.startswith("param/")]
    experts = [k for k in params if ".mlp.experts." in k]
    assert len(experts) == 4 and all(e2_state[k].shape[0] == 4 for k in experts)
    for run, state in ((e1, e1_state), (e2, e2_state)):
        for key in ("pg_loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(run[key]), torch.tensor(one[key]), rtol=1e-6, atol=1e-9)
        assert run["old_logprobs"].keys() == one["old_logprobs"].keys()
        for response, values in run["old_logprobs"].items():
            torch.testing.assert_close(torch.tensor(values), torch.tensor(one["old_logprobs"][response]),
                                       rtol=1e-6, atol=1e-6)
        for name in params:
            assert (state[name] - one_state[name]).norm() <= 1e-6 * one_state[name].norm(), name
    initial = _dump(runs, "initial_e2")[1]
    assert all((initial[n] - one_state[n]).abs().max() > 1e-3 for n in params if "norm" not in n)
    # The experts' gradient norm is reduced one mesh dimension at a time by flashdapo, not by DTensor's stacked
    # norms (which warned on every rank that it could not merge its two all-reduces).
    assert "sequential all_reduce" not in (runs / "two.log").read_text()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_expert_parallel_groups_train_as_one_rank(runs, tmp_path):
    """4 ranks at E = 2: each expert on 2 ranks, FSDP2-sharded over them (the "efsdp" dimension of size 2, its
    gradients reduce-scattered there): the same losses, norms and parameters as 1 rank."""
    torchrun(4, str(SCRIPT), str(tmp_path), "four")
    (one, one_state), (four, state) = _dump(runs, "one"), _dump(tmp_path, "e2x4")
    assert four["layout"] == [{"mesh": ["efsdp", "ep"], "rows": 1}] * 4
    for key in ("pg_loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(four[key]), torch.tensor(one[key]), rtol=1e-6, atol=1e-9)
    for name in (k for k in one_state if k.startswith("param/")):
        assert (state[name] - one_state[name]).norm() <= 1e-6 * one_state[name].norm(), name


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoints_and_loading_reshard_across_expert_parallel_sizes(runs):
    """A checkpoint written at E = 2 on 2 ranks loads at E = 1 on 1 rank, and one written at E = 1 on 2 ranks
    loads at E = 2, into differently seeded models: the same parameters and AdamW state, bit for bit. The
    trainer's loader (rank 1 on the meta device, rank 0's tensors broadcast) fills E = 2 shards with the
    model directory's tensors."""
    for loaded, saved in (("one_from_e2", "e2"), ("e2_from_e1", "e1")):
        state, expected = _dump(runs, loaded)[1], _dump(runs, saved)[1]
        assert state.keys() == expected.keys() and any(k.startswith("optim/") for k in state)
        for name, value in expected.items():
            assert torch.equal(state[name], value), (loaded, name)
    source = AutoModelForCausalLM.from_pretrained(runs / "model_dir", dtype=torch.float32).state_dict()
    loaded = _dump(runs, "loaded")[1]
    assert loaded.keys() == {f"param/{n}" for n in source}
    for name, value in source.items():
        assert torch.equal(loaded[f"param/{name}"], value), name


def _env(world_size: int) -> DistEnv:
    """A DistEnv of `world_size` ranks for the checks that run before any mesh is built (no process group)."""
    return DistEnv(rank=0, local_rank=0, world_size=world_size, device=torch.device("cpu"), mesh=None)


def test_settings_that_cannot_work_are_one_line():
    moe = expert_modules(tiny_moe(seed=0))
    assert len(moe) == 2 and all(m.num_experts == 4 for m in moe)
    check_expert_parallel(moe, 1)
    check_expert_parallel(moe, 2)
    check_expert_parallel([], 1)  # a dense model at E = 1
    cases = [
        (lambda: check_expert_parallel(moe, 3), "trainer.expert_parallel=3 must divide the model's num_experts 4"),
        (lambda: check_expert_parallel([], 2), "the model has no MoE layer"),
        (lambda: expert_parallel_mesh(_env(3), 2), "must divide the data-parallel world size 3"),
    ]
    biased = moe[0]
    biased.gate_up_proj_bias = nn.Parameter(torch.zeros(4, 16))
    cases.append((lambda: check_expert_parallel([biased], 2), "(gate_up_proj_bias), which expert parallelism"))
    for call, message in cases:
        with pytest.raises(ExpertParallelError) as err:
            call()
        assert message in str(err.value) and "\n" not in str(err.value)
    # At start-up, before any model is loaded: the launch's world size.
    with pytest.raises(ConfigError) as err:
        check_batch_layout(merge(toy(), {"trainer": {"expert_parallel": 2}}), 3)
    assert str(err.value).startswith("trainer.expert_parallel: 2 does not divide the world size 3")

"""`flashdapo plan` counts split placement's staged weights in host memory: k + 1 versions x parameters x bytes of
the dtype the rollout side loads, per rollout rank and per node; it refuses, in one line, a node whose host
memory (when the GPU table records it) cannot hold them, and otherwise says it did not check."""

import dataclasses

import pytest

import flashdapo.plan.command as plan_command
from flashdapo.__main__ import main
from flashdapo.kernels.gpus import GPU, GPUS

SEVEN_B = ["--preset", "qwen2.5-7b-math", "--nodes", "2", "--gpus-per-node", "8"]
SPLIT = ["--rollout.placement", "split", "--rollout.rollout-ranks", "8"]
PARAMETERS = 7_615_616_512


@dataclasses.dataclass(frozen=True)
class NodeGPU(GPU):
    """An H20 whose table row also records its nodes' host memory."""

    host_memory_gib: float = 0.0


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["plan", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def _staged_line(out: str) -> str:
    return next((x for x in out.splitlines() if "staged weights" in x), "")


@pytest.mark.parametrize(("extra", "versions", "width"), [([], 2, 2), (["--rollout.max-lag", "2"], 3, 2),
                                                          (["--model.dtype", "float32"], 2, 4)])
def test_the_plan_reports_the_staged_weights_per_rollout_rank_and_per_node(capsys, extra, versions, width):
    status, out, err = _plan(capsys, *SEVEN_B, *SPLIT, *extra)
    assert status == 0, err
    per_rank = versions * PARAMETERS * width
    line = _staged_line(out)
    assert (f"{per_rank / 2**30:.1f} GiB per rollout rank ({versions} versions x {PARAMETERS:,} parameters x {width} "
            f"bytes), {8 * per_rank / 2**30:.1f} GiB per node (8 rollout rank(s)) (exact)") in line, out
    assert "not in the GPU table (kernels/gpus.py): not checked" in line


def test_colocated_placement_stages_nothing(capsys):
    status, out, _ = _plan(capsys, *SEVEN_B)
    assert status == 0 and _staged_line(out) == ""


@pytest.mark.parametrize(("host_gib", "refused"), [(200, True), (512, False)])
def test_a_node_whose_host_memory_is_known_is_checked(capsys, monkeypatch, host_gib, refused):
    """7B at k = 1, 8 rollout ranks on a node: 227.0 GiB of bf16 staged weights."""
    h20 = {f.name: getattr(GPUS["h20"], f.name) for f in dataclasses.fields(GPU)}
    monkeypatch.setattr(plan_command, "gpu_named", lambda _key: NodeGPU(**h20, host_memory_gib=host_gib))
    status, out, err = _plan(capsys, *SEVEN_B, *SPLIT)
    if refused:
        assert status == 1 and out == "" and err.count("\n") == 1, err
        assert err.startswith("flashdapo plan: cannot launch: rollout.max_lag: split placement stages 2 versions of "
                              "the weights in host memory on each rollout rank (28.4 GiB, exact), 227.0 GiB for the 8 "
                              "rollout ranks of a node, over a node's 200.0 GiB"), err
    else:
        assert status == 0, err
        assert "227.0 GiB per node (8 rollout rank(s)) (exact); within a node's 512.0 GiB" in _staged_line(out)

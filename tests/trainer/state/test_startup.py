"""The start every rank agrees on, one rank's view at a time (the other ranks' answers stand in for the
collectives): rank 0's choice of checkpoint is every rank's, and a rank that cannot see it stops all of them
in one line. The real thing, two launchers on one machine, is tests/trainer/test_nodes.py."""

from pathlib import Path

import pytest
import torch

from flashdapo.distributed.mesh import DistEnv
from flashdapo.trainer.state import startup
from flashdapo.trainer.state.checkpoint import CheckpointError
from flashdapo.trainer.state.run_settings import ResumeRefused
from tests.helpers.runs import quick_config


def _env(rank: int) -> DistEnv:
    return DistEnv(rank=rank, local_rank=0, world_size=2, device=torch.device("cpu"), mesh=None)


def _checkpoint(root, step):
    path = root / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    for name in ("COMPLETE", ".metadata", "trainer_state.pt"):
        (path / name).write_text('{"run_id": "run-a"}' if name == "COMPLETE" else "x")
    return path


def test_every_rank_resumes_what_rank0_chose_whatever_it_sees_itself(tmp_path, monkeypatch):
    mine = _checkpoint(tmp_path / "rank1-view", 6)  # rank 1's own view holds a newer checkpoint
    chosen = str(tmp_path / "run" / "checkpoints" / "step_00000004")
    monkeypatch.setattr(startup, "broadcast_object", lambda obj, src=0: ("run-a", [chosen]))
    cfg = quick_config(mine.parents[2], checkpoint={"resume": "auto"})
    assert startup.choose_resume(cfg, _env(1), mine.parents[2], print) == ("run-a", [Path(chosen)])
    refused = ResumeRefused("rank 0's refusal")
    monkeypatch.setattr(startup, "broadcast_object", lambda obj, src=0: refused)
    with pytest.raises(ResumeRefused, match="rank 0's refusal"):
        startup.choose_resume(cfg, _env(1), mine.parents[2], print)


def test_a_rank_that_cannot_see_the_chosen_checkpoint_stops_every_rank_in_one_line(tmp_path, monkeypatch):
    chosen = _checkpoint(tmp_path, 4)
    unseen = [f"{chosen}/COMPLETE", f"{chosen}/.metadata"]
    monkeypatch.setattr(startup, "all_gather_objects", lambda obj: [obj, ("node-b", unseen)])
    with pytest.raises(CheckpointError) as info:
        startup.check_visible([chosen], _env(0))
    assert str(info.value) == (f"rank 1 on host node-b cannot see the checkpoint rank 0 resumes from (no {chosen}/"
                               "COMPLETE there, and 1 more file(s)); " + startup.SHARED_STORAGE_ADVICE)
    monkeypatch.setattr(startup, "all_gather_objects", lambda obj: [obj, ("node-b", [])])
    startup.check_visible([chosen], _env(0))  # every rank sees it

"""logging.dump_rollouts_every: training rollouts (trained / filtered / unused, with advantages) and
validation generations written as jsonl in the run dir."""

import errno
import json
from pathlib import Path

import torch

from flashdapo.config import toy
from flashdapo.distributed.mesh import DistEnv
from flashdapo.trainer.batch import build_train_batch
from flashdapo.trainer.dumps import dump_train_rollouts
from flashdapo.trainer.loop import train

from .scripted import PlainTokenizer
from .test_loop import _collect, tiny_config


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_generated_group_is_dumped_with_its_status_and_advantages(tmp_path):
    # Prompts 0..11, 4 per round; informative 1, 2 | 5 | 8, 9, 10: train_batch 4 trains 1, 2, 5, 8.
    collected = _collect({1, 2, 5, 8, 9, 10}, keep_generated=True)
    responses = [r for g in collected.groups for r in g.responses]
    batch = build_train_batch(collected.mini_batches, [torch.zeros(len(r)) for r in responses], toy().algorithm)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), mesh=None)
    dump_train_rollouts(tmp_path, 7, collected.generated, batch, PlainTokenizer(), env)
    rows = _lines(tmp_path / "rollouts" / "train_step_000007.jsonl")
    assert [int(r["prompt"]) for r in rows] == list(range(12)) and [r["round"] for r in rows] == [1] * 4 + [2] * 4 + [3] * 4
    status = {int(r["prompt"]): r["status"] for r in rows}
    assert [p for p, s in status.items() if s == "trained"] == [1, 2, 5, 8]
    assert [p for p, s in status.items() if s == "unused"] == [9, 10]
    assert all(s == "filtered" for p, s in status.items() if p not in (1, 2, 5, 8, 9, 10))
    trained = next(r for r in rows if r["prompt"] == "1")
    assert trained["acc"] == [True, False, False, False] and trained["scores"][0] > trained["scores"][1]
    assert trained["advantages"][0] > 0 > trained["advantages"][1] and len(trained["responses"]) == 4
    assert all(r["advantages"] is None for r in rows if r["status"] != "trained")


def test_training_run_dumps_rollouts_and_validation_per_source(tmp_path):
    run_dir = tmp_path / "run"
    run = train(tiny_config(run_dir, trainer={"total_steps": 1}, checkpoint={"export_hf": False},
                            logging={"dump_rollouts_every": 1}))
    rows = _lines(run_dir / "rollouts" / "train_step_000001.jsonl")
    assert len(rows) == 4 and all(r["status"] == "trained" and len(r["advantages"]) == 4 for r in rows)
    for step in (0, 1):
        val = _lines(run_dir / "rollouts" / f"val_step_{step:06d}.jsonl")
        assert len(val) == 6 and all(len(v["samples"]) == 2 and v["data_source"] == "toy_arithmetic" for v in val)
    last = run.logger.history[-1]
    assert last["val/toy_arithmetic/acc/mean@k"] == last["val/acc/mean@k"]
    assert "val/toy_arithmetic/acc/pass@1" in last


def test_a_failed_dump_warns_once_and_training_goes_on(tmp_path, capsys, monkeypatch):
    real_write = Path.write_text

    def full_disk(path, *args, **kwargs):  # every dump write fails as on a full disk; other files are written
        if path.parent.name == "rollouts":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    run_dir = tmp_path / "run"
    run = train(tiny_config(run_dir, trainer={"total_steps": 2}, checkpoint={"export_hf": False},
                            logging={"dump_rollouts_every": 1}))
    assert [int(m["step"]) for m in run.logger.history if "train/num_gen_batches" in m] == [1, 2]
    warnings = [line for line in capsys.readouterr().out.splitlines() if "cannot write the rollout dump" in line]
    assert len(warnings) == 1 and "No space left" in warnings[0], warnings
    assert list((run_dir / "rollouts").iterdir()) == [], "no partial file is left behind"

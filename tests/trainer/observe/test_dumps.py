"""logging.dump_rollouts_every: training rollouts (trained / filtered / unused, with advantages; under
streaming also next_step) and validation generations written as jsonl in the run dir."""

import errno
import json
from pathlib import Path

import torch

from flashdapo.config import toy
from flashdapo.distributed.mesh import DistEnv
from flashdapo.profiling import StageTimer
from flashdapo.reward import Verdict
from flashdapo.trainer.batch import build_train_batch
from flashdapo.trainer.collect.streaming import StreamState, stream_groups
from flashdapo.trainer.loop import train
from flashdapo.trainer.observe.dumps import dump_train_rollouts
from tests.helpers.collecting import ENV, N, collect, long_tail, stream_config, stream_sampler
from tests.helpers.runs import tiny_config
from tests.trainer.scripted import PlainTokenizer, ScriptedStream


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_generated_group_is_dumped_with_its_status_and_advantages(tmp_path):
    # Prompts 0..11, 4 per round; informative 1, 2 | 5 | 8, 9, 10: train_batch 4 trains 1, 2, 5, 8.
    collected = collect({1, 2, 5, 8, 9, 10}, keep_generated=True)
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


def one_in_three_all_wrong(text: str, truth: str) -> Verdict:
    """Prompts 0, 3, 6, ...: every response wrong (filtered); the others: response 0 right."""
    prompt, member = map(int, text.split()[:2])
    ok = prompt % 3 != 0 and member == 0
    return Verdict(1.0 if ok else -1.0, ok, text)


def test_streaming_dumps_every_finished_group_and_those_kept_for_the_next_step(tmp_path):
    cfg = stream_config(carry=True)
    state, sampler, engine = StreamState(), stream_sampler(cfg), ScriptedStream(long_tail, N)
    earlier: list[str] = []  # the previous step's next_step prompts
    rolled = 0
    for step in range(1, 6):
        engine.version = step
        collected, stats = stream_groups(step, state, sampler, engine, PlainTokenizer(), one_in_three_all_wrong, cfg,
                                         ENV, StageTimer(ENV.device), version=step, keep_generated=True)
        responses = [r for g in collected.groups for r in g.responses]
        batch = build_train_batch(collected.mini_batches, [torch.zeros(len(r)) for r in responses], cfg.algorithm)
        dump_train_rollouts(tmp_path, step, collected.generated, batch, PlainTokenizer(), ENV, past_target="next_step")
        rows = _lines(tmp_path / "rollouts" / f"train_step_{step:06d}.jsonl")
        by_status = {s: [r["prompt"] for r in rows if r["status"] == s] for s in ("trained", "filtered", "next_step")}
        # Those kept past the last target (first in line: they train), and every group that finished in this step.
        assert set(earlier) <= set(by_status["trained"])
        assert len(rows) == len(earlier) + stats.finished_groups == sum(map(len, by_status.values()))
        assert len(by_status["trained"]) == 4 and by_status["trained"] == [str(int(g.prompt[0])) for g in collected.groups]
        assert all(int(p) % 3 == 0 for p in by_status["filtered"])
        assert len(by_status["filtered"]) == stats.all_equal_groups > 0
        assert [str(int(g.prompt[0])) for g in state.ready] == by_status["next_step"]
        earlier = by_status["next_step"]
        rolled += len(earlier)
    assert rolled, "some step kept groups past its target"


def test_a_streaming_run_dumps_its_groups(tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_config(run_dir, trainer={"total_steps": 1, "val_every": 0}, checkpoint={"export_hf": False},
                      rollout={"streaming": True}, logging={"dump_rollouts_every": 1, "plot": False}))
    rows = _lines(run_dir / "rollouts" / "train_step_000001.jsonl")
    # Without dynamic sampling every group of the batch trains, as in rounds.
    assert len(rows) == 4 and all(r["status"] == "trained" and len(r["advantages"]) == 4 for r in rows)


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

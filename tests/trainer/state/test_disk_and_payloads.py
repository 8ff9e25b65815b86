"""A full disk while a checkpoint or split placement's rollout part is written, and files flashdapo did not
write in them (a pickled object where flashdapo writes only tensors and plain data): one line each, naming
the file and what to do, never torch's "unexpected pos" or its hint to load with weights_only=False; a bad
per-rank state skips its checkpoint for an older one, as a bad trainer_state.pt does. Single process."""

import io
import os
from collections import namedtuple

import pytest
import torch

from flashdapo.distributed.mesh import DistEnv
from flashdapo.trainer.collect.rounds import Collected
from flashdapo.trainer.split import cut
from flashdapo.trainer.split.wire import BatchMessage, pack, unpack
from flashdapo.trainer.state import checkpoint as ckpt
from flashdapo.trainer.state.checkpoint import (
    CheckpointError,
    TrainerState,
    load_first_loadable,
    resume_candidates,
    save_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), mesh=None)
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
"""What torch's zip writer (torch.save, DCP's shards) raises when the disk fills: the errno is lost."""
Usage = namedtuple("Usage", "total used free")


class Payload:
    """A pickled object that would run a command if unpickled (weights_only refuses it)."""

    def __reduce__(self):
        return (os.system, ("echo unpickled > /dev/null",))


def torch_writer_fails(*_args, **_kwargs):
    raise RuntimeError(TORCH_FULL)


def pickled_payload() -> bytes:
    buffer = io.BytesIO()
    torch.save({"step": 1, "payload": Payload()}, buffer)
    return buffer.getvalue()


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(run_dir, model, optimizer, step, rank_state=None):
    state = TrainerState(step=step, scheduler={"last_epoch": step}, sampler={"position": step}, run_id="run-a")
    return save_checkpoint(run_dir, ENV, model, optimizer, state, keep_last=5, rank_state=rank_state)


def _refused_plainly(message: str) -> None:
    assert "\n" not in message and "weights_only" not in message and "will likely succeed" not in message
    assert "not a file flashdapo wrote, or a corrupted one" in message and "pickled Python object" in message


@pytest.mark.parametrize("where", ["trainer_state.pt", "model shards (DCP)"])
def test_a_full_disk_in_torchs_writer_says_no_space_not_unexpected_pos(tmp_path, monkeypatch, where):
    model, optimizer = _model_and_optimizer()
    first = _save(tmp_path, model, optimizer, 1)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    real_save = torch.save

    def save_until_full(obj, f, *args, **kwargs):
        if where.startswith("model") or str(f).endswith(where):
            raise RuntimeError(TORCH_FULL)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save_until_full)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _p: Usage(2 << 20, 2 << 20, 0))
    with pytest.raises(CheckpointError) as info:
        _save(tmp_path, model, optimizer, 2)
    message = str(info.value)
    assert "\n" not in message and "inline_container" not in message and "unexpected pos" not in message
    assert message.startswith(f"cannot write checkpoint {tmp_path / 'checkpoints' / 'step_00000002'}: No space left "
                              f"on device (0 B free of 2.0 MiB on the disk holding {tmp_path / 'checkpoints'})")
    assert "free disk space" in message and "--checkpoint.resume auto" in message
    monkeypatch.undo()
    # The invariant: nothing half-written is published, the older checkpoint is as it was.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [first.name]
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before


def test_a_write_torch_cuts_short_on_a_disk_with_room_is_not_called_a_full_disk(tmp_path, monkeypatch):
    model, optimizer = _model_and_optimizer()
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        return (torch_writer_fails if str(f).endswith("rng_rank0.pt") else real_save)(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)
    with pytest.raises(CheckpointError) as info:
        _save(tmp_path, model, optimizer, 1)
    message = str(info.value)
    assert "a write was cut short" in message and "No space" not in message and "unexpected pos" not in message


def test_a_pickled_trainer_state_is_named_as_not_flashdapos_without_torchs_hint(tmp_path):
    model, optimizer = _model_and_optimizer()
    path = _save(tmp_path, model, optimizer, 1)
    (path / "trainer_state.pt").write_bytes(pickled_payload())
    with pytest.raises(CheckpointError) as info:
        load_first_loadable(resume_candidates("auto", tmp_path), ENV, model, optimizer, lambda _m: None)
    _refused_plainly(str(info.value))
    assert str(path / "trainer_state.pt") in str(info.value)


def test_a_pickled_stream_rank_state_skips_its_checkpoint_for_an_older_one(tmp_path):
    model, optimizer = _model_and_optimizer()
    older = _save(tmp_path, model, optimizer, 1, rank_state={"carried": [torch.arange(3)]})
    newest = _save(tmp_path, model, optimizer, 2, rank_state={"carried": [torch.arange(4)]})
    (newest / "stream_rank0.pt").write_bytes(pickled_payload())
    warnings = []
    loaded = load_first_loadable(resume_candidates("auto", tmp_path), ENV, model, optimizer, warnings.append)
    assert loaded is not None and loaded[0] == older and loaded[1].step == 1
    (warning,) = warnings
    assert warning.startswith("warning: skipping checkpoint step_00000002, it does not load") and "older one" in warning
    assert str(newest / "stream_rank0.pt") in warning
    _refused_plainly(warning)
    assert torch.equal(ckpt.load_rank_state(older, ENV)["carried"][0], torch.arange(3))


# ---------------------------------------------------------------------------------------------------
# Split placement's rollout part (cut.py)


def test_a_full_disk_while_the_rollout_part_is_written_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(cut.torch, "save", torch_writer_fails)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _p: Usage(1 << 30, 1 << 30, 4096))
    with pytest.raises(CheckpointError) as info:
        cut.write_part(tmp_path, 1, 2, 0, {"sampler": {}}, [b"batch 2"])
    message = str(info.value)
    part = cut.part_dir(tmp_path, 1)
    assert "\n" not in message and "unexpected pos" not in message
    assert message.startswith(f"cannot write {part} (the rollout side's part of the cut of step 1): No space left on "
                              "device (4.0 KiB free of 1.0 GiB")
    assert "--checkpoint.resume auto" in message
    assert not part.exists() and not part.with_name(part.name + ".tmp").exists()  # nothing half-written is left


def _part(run_dir, queue: list[bytes], state_file: bytes | None = None):
    cut.write_part(run_dir, 1, 2, 0, {"sampler": {"position": 1}, "carried": [], "stream": None}, queue)
    part = cut.part_dir(run_dir, 1)
    if state_file is not None:
        (part / "rank0.pt").write_bytes(state_file)
    return part


def test_a_pickled_queued_batch_is_refused_at_the_resume_in_one_line(tmp_path):
    part = _part(tmp_path, [pickled_payload()])
    with pytest.raises(CheckpointError) as info:
        cut.read_queue(tmp_path, 1)
    message = str(info.value)
    _refused_plainly(message)
    assert message.startswith(f"{part / 'queue.pt'}: queued batch 2: ") and f"remove {part}" in message
    with pytest.raises(CheckpointError):  # so the checkpoint of step 1 is skipped for an older one
        cut.require_part(tmp_path, 1, tmp_path / "checkpoints" / "step_00000001")


def test_a_pickled_rollout_rank_state_is_named_and_skips_the_checkpoint(tmp_path):
    part = _part(tmp_path, [], state_file=pickled_payload())
    with pytest.raises(CheckpointError) as info:
        cut.read_rank_state(tmp_path, 1, 0)
    _refused_plainly(str(info.value))
    assert str(part / "rank0.pt") in str(info.value)
    with pytest.raises(CheckpointError) as info:
        cut.require_part(tmp_path, 1, tmp_path / "checkpoints" / "step_00000001")
    _refused_plainly(str(info.value))


def test_a_sound_part_still_reads_back(tmp_path):
    collected = Collected(mini_batches=[], num_gen_batches=1, groups_generated=2, groups_informative=1, gen_acc=0.5,
                          gen_score=0.0, gen_truncated=0.0, generated=[])
    batch = pack(BatchMessage(batch=2, weights_step=0, groups=[], collected=collected))
    _part(tmp_path, [batch])
    cut.require_part(tmp_path, 1, tmp_path / "checkpoints" / "step_00000001")
    assert cut.read_queue(tmp_path, 1) == [batch] and unpack(batch).collected.groups_generated == 2
    assert cut.read_rank_state(tmp_path, 1, 0)["sampler"] == {"position": 1}

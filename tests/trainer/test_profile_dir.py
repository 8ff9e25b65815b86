"""profile.dir that cannot hold the profiles (a file, a file in the way of its folder): one line at the start
of the run, before the model loads and any step runs, not FileExistsError's traceback at the profiled step."""

import pytest

from flashdapo.__main__ import main as cli
from flashdapo.config import ProfileConfig
from tests.helpers.runs import TINY

TWO_STEPS = ["--trainer.total-steps", "2", "--checkpoint.save-every", "0", "--checkpoint.export-hf", "False",
             "--model.toy.sft-steps", "0"]


@pytest.mark.parametrize("under", [False, True], ids=["a file", "under a file"])
def test_a_profile_dir_that_is_a_file_stops_the_run_before_any_step(tmp_path, capsys, under):
    a_file = tmp_path / "trace.json"
    a_file.write_text("mine")
    profile_dir = a_file / "sub" if under else a_file
    run_dir = tmp_path / "run"
    assert cli(["train", *TINY, *TWO_STEPS, "--logging.run-dir", str(run_dir), "--profile.steps", "1",
                "--profile.dir", str(profile_dir)]) == 1
    captured = capsys.readouterr()
    expected = (f"cannot create it, {a_file} is a file, not a directory; choose another path" if under else
                "is a file, not a directory; give a directory for the profiles of profile.steps (or leave profile.dir "
                "empty: RUN_DIR/profile)")
    assert captured.err.startswith(f"flashdapo: error: profile.dir={profile_dir}") and expected in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert "step    1" not in captured.out and not (run_dir / "metrics.jsonl").exists()
    assert a_file.read_text() == "mine"


def test_only_ranks_that_profile_check_it_and_the_default_is_created(tmp_path):
    from flashdapo.profiling.step import ProfileDirError, check_profile_dir

    a_file = tmp_path / "trace.json"
    a_file.write_text("mine")
    check_profile_dir(ProfileConfig(steps=[1], ranks=[1], dir=str(a_file)), tmp_path, rank=0)  # rank 0 profiles nothing
    check_profile_dir(ProfileConfig(steps=[], dir=str(a_file)), tmp_path, rank=0)  # profiling off
    with pytest.raises(ProfileDirError):
        check_profile_dir(ProfileConfig(steps=[1], ranks=[1], dir=str(a_file)), tmp_path, rank=1)
    check_profile_dir(ProfileConfig(steps=[1]), tmp_path / "run", rank=0)
    assert list((tmp_path / "run" / "profile").iterdir()) == []  # created, the write check leaves nothing

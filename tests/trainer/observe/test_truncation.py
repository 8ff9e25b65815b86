"""The one-line warning when a step's responses were all truncated (observe/truncation.py, called by the loop)."""

from __future__ import annotations

from flashdapo.tokenizer import load_tokenizer
from flashdapo.trainer.observe.truncation import TruncationWatch, all_truncated
from tests.helpers.llama3_dir import llama3_model_dir


def test_all_truncated_reads_the_generated_fraction_first():
    assert all_truncated({"train/gen_truncated": 1.0, "response_length/clip_ratio": 0.5})
    assert not all_truncated({"train/gen_truncated": 0.75, "response_length/clip_ratio": 1.0})
    assert all_truncated({"response_length/clip_ratio": 1.0})  # split placement: nothing generated this step
    assert not all_truncated({"step": 3})


def test_warns_once_naming_the_stop_ids_and_the_length(tmp_path):
    model = llama3_model_dir(tmp_path / "llama3", generation_eos=["<|end_of_text|>"])
    tok = load_tokenizer(str(model))
    watch = TruncationWatch(tok, str(model), 512)
    assert watch.check(1, {"train/gen_truncated": 0.5}) is None
    lines = [watch.check(step, {"train/gen_truncated": 1.0}) for step in (2, 3, 4)]
    assert lines[1:] == [None, None]
    line = lines[0]
    assert line is not None and "\n" not in line and line.startswith("warning: step 2: every response was truncated")
    assert "rollout.max_response_length=512" in line
    assert "1 '<|end_of_text|>', 4 '<|eot_id|>'" in line


def test_the_loop_warns_once_when_every_response_is_truncated(tmp_path, capsys):
    """The toy run with one token per response: every response truncated, the warning printed once."""
    from flashdapo.trainer.loop import train
    from tests.helpers.runs import tiny_config

    cfg = tiny_config(tmp_path / "run", rollout={"max_response_length": 1},
                      algorithm={"overlong_buffer_len": 1},
                      trainer={"total_steps": 2, "val_before_train": False, "val_every": 0},
                      logging={"plot": False})
    train(cfg)
    lines = [line for line in capsys.readouterr().out.splitlines() if "every response was truncated" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("flashdapo: warning: step 1:") and "rollout.max_response_length=1 " in lines[0]
    assert "'<|im_end|>'" in lines[0] and "'<|endoftext|>'" in lines[0]

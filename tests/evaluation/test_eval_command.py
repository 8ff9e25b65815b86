"""`flashdapo eval`: options derived from the config tree, checked before the model loads; its table."""

import pytest

from flashdapo.__main__ import main as cli
from flashdapo.config import Config, preset
from flashdapo.eval.command import OPTIONS, eval_args_class


def test_options_take_defaults_and_checks_from_the_tree(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("")
    for base in (Config(), preset("toy")):
        args = eval_args_class(base)(model=str(tmp_path), data=[str(data)], out=str(tmp_path / "out"))
        for option, path in OPTIONS.items():
            section, leaf = path.rsplit(".", 1)
            assert getattr(args, option) == getattr(eval(f"base.{section}"), leaf), option
    assert (args.k, args.max_new_tokens) == (preset("toy").rollout.val_n, preset("toy").rollout.max_response_length)


def test_config_file_sets_the_defaults(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("rollout: {val_n: 0}\n")
    assert cli(["eval", "--config", str(config), "--model", str(tmp_path), "--data", "x.jsonl", "--out", "o"]) == 2
    assert "rollout.val_n: expected >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--k", "0"], "eval.k: expected >= 1, got 0"),
    (["--temperature", "nan"], "eval.temperature: expected a finite number, got nan"),
    (["--temperature", "0"], "eval.temperature: expected > 0, got 0.0"),
    (["--top-p", "1.5"], "eval.top_p: expected a value in (0, 1], got 1.5"),
    (["--batch-size", "0"], "eval.batch_size: expected >= 1, got 0"),
    (["--max-new-tokens", "-1"], "eval.max_new_tokens: expected >= 1, got -1"),
    (["--data", "missing.jsonl"], "eval.data: expected one or more existing .parquet or .jsonl files, got "
                                  "['missing.jsonl']"),
    (["--prompts-per-call", "-1"], "eval.prompts_per_call: expected >= 0, got -1"),
    (["--engine", "sglang"], None),
    (["--fsdp", "--engine", "vllm"], "eval.fsdp: expected false with --engine vllm (vLLM shards with "
                                     "--tensor-parallel-size), got True"),
    (["--model", "missing-dir"], "eval.model: expected an existing directory, got 'missing-dir'"),
])
def test_bad_options_stop_before_the_model_loads(tmp_path, capsys, flags, message):
    # The model directory is empty: loading it would fail with another error, so each message below
    # shows that the options were checked first.
    data = tmp_path / "d.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    argv = ["eval", "--model", str(tmp_path), "--data", str(data), "--out", str(tmp_path / "out")] + flags
    if message is None:  # not a choice: tyro's usage error
        with pytest.raises(SystemExit):
            cli(argv)
        assert "sglang" in capsys.readouterr().err
        return
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err == f"flashdapo: config error: {message}\n"

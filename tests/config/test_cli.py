"""The one command-line parser (config/cli.py): every command reads a bool the same way, refuses a value it
cannot read in one line (exit status 2), and the config tree imports without the parser's tyro or yaml."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flashdapo.__main__ import main
from flashdapo.config.cli import with_switch_values

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["train", "config", "plan", "eval", "generate", "ablate"]
BOOL_FLAG = {"eval": "--fsdp", "generate": "--examples"}
"""The bool option each command is given (the others: a field of the config tree)."""
INT_FLAGS = {"train": ["--trainer.total-steps"], "config": ["--trainer.seed"], "plan": ["--nodes", "--mfu"],
             "eval": ["--k"], "generate": ["--n"], "ablate": ["--seeds", "--trainer.total-steps"]}
"""Number options of each command: its own and the config tree's."""


class _Parsed(Exception):
    """Raised in place of the command's work, carrying what it would have run with."""


def _stop_after_parsing(monkeypatch) -> None:
    """Every command stops, raising _Parsed, where its work would begin."""
    import flashdapo.ablation.command as ablate
    import flashdapo.eval.command as evaluate
    import flashdapo.eval.generate as generate
    import flashdapo.plan.command as plan
    import flashdapo.trainer.loop as loop

    def stop(*args, **kwargs):
        raise _Parsed(args[0])

    for module, name in [(loop, "train"), (plan, "model_source"), (evaluate, "run_eval"),
                         (generate, "run_generate"), (ablate, "run_panels"), (ablate, "run_ablation")]:
        monkeypatch.setattr(module, name, stop)


def _required(command: str, tmp_path: Path, examples: bool = True) -> list[str]:
    """The options `command` needs besides the one under test: a model directory and data for eval, a source
    of prompts for generate (`--examples`, or a typed prompt when --examples is false)."""
    if command == "eval":
        data = tmp_path / "d.jsonl"
        data.write_text('{"problem": "1+1", "answer": "2"}\n')
        return ["--model", str(tmp_path), "--data", str(data), "--out", str(tmp_path / "out")]
    if command == "generate":
        return ["--model", str(tmp_path)] + ([] if examples else ["--prompt", "Compute 2+3."])
    return []


def _bool_read(command: str, argv: list[str], capsys) -> bool:
    """The value the command read for its bool option."""
    if command == "config":
        assert main(["config", *argv]) == 0
        return yaml.safe_load(capsys.readouterr().out)["logging"]["plot"]
    with pytest.raises(_Parsed) as parsed:
        main([command, *argv])
    value = parsed.value.args[0]
    return {"eval": lambda: value.fsdp, "generate": lambda: value.examples}.get(command, lambda: value.logging.plot)()


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("word", "value"), [("false", False), ("False", False), ("0", False), ("true", True),
                                             ("True", True), ("1", True)])
def test_every_command_reads_a_bool_the_same_way(command, word, value, tmp_path, capsys, monkeypatch):
    _stop_after_parsing(monkeypatch)
    flag = BOOL_FLAG.get(command, "--logging.plot")
    argv = [*_required(command, tmp_path, examples=value), flag, word]
    assert _bool_read(command, argv, capsys) is value


def test_ablate_reads_its_own_bools_and_the_configs_alike():
    from flashdapo.ablation.command import parse_ablate_args

    opts, cfg = parse_ablate_args(["--step-lines", "0", "--logging.plot", "False", "--quick"])
    assert (opts.step_lines, cfg.logging.plot, opts.quick) == (False, False, True)


def _refused(command: str, argv: list[str], capsys) -> str:
    """The one line `command` refuses argv with (exit status 2)."""
    with pytest.raises(SystemExit) as exit_:
        main([command, *argv])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"flashdapo {command}: error: ") and "╭" not in captured.err
    return captured.err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_bool_is_refused_in_one_line_by_every_command(command, tmp_path, capsys, monkeypatch):
    _stop_after_parsing(monkeypatch)
    flag = BOOL_FLAG.get(command, "--logging.plot")
    err = _refused(command, [*_required(command, tmp_path), flag, "maybe"], capsys)
    assert f"{flag}: invalid choice 'maybe'; expected true or false" in err, err


@pytest.mark.parametrize(("command", "flag"), [(c, f) for c in COMMANDS for f in INT_FLAGS[c]])
def test_a_number_that_is_none_is_refused_in_one_line_by_every_command(command, flag, tmp_path, capsys,
                                                                       monkeypatch):
    _stop_after_parsing(monkeypatch)
    err = _refused(command, [*_required(command, tmp_path), flag, "abc"], capsys)
    expected = "a number" if flag == "--mfu" else "an integer"
    assert f"{flag}: expected {expected}, got 'abc'" in err, err


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_option_is_refused_in_one_line_by_every_command(command, tmp_path, capsys, monkeypatch):
    _stop_after_parsing(monkeypatch)
    err = _refused(command, [*_required(command, tmp_path), "--trainer.total-stepz", "3"], capsys)
    assert "unrecognized argument(s): --trainer.total-stepz 3" in err, err


def test_plan_checks_its_own_options_as_the_config_tree_does(capsys):
    assert main(["plan", "--mfu", "1.5"]) == 2
    assert capsys.readouterr().err == "flashdapo: config error: plan.mfu: expected a value in (0, 1], got 1.5\n"
    assert main(["plan", "--nodes", "-1"]) == 2
    assert capsys.readouterr().err == ("flashdapo: config error: plan.nodes: expected null or >= 1 (leave it out for "
                                       "the preset's first documented cluster), got -1\n")


def test_a_switch_alone_is_true_and_its_no_form_false():
    switches = ("--fsdp", "--progress")
    assert with_switch_values(["--fsdp", "--k", "3", "--no-progress"], switches) == \
        ["--fsdp", "true", "--k", "3", "--progress", "false"]
    assert with_switch_values(["--k", "3", "--fsdp"], switches) == ["--k", "3", "--fsdp", "true"]
    # a value given is kept, a bad one too (for the parser to refuse); other bools take their value
    assert with_switch_values(["--fsdp", "0", "--progress", "maybe", "--logging.plot"], switches) == \
        ["--fsdp", "0", "--progress", "maybe", "--logging.plot"]


def test_the_config_tree_imports_without_tyro_or_yaml():
    # The GPU machines' image has neither: only the command line (config/cli.py) and config files need them.
    code = ("import sys\nsys.modules['tyro'] = None\nsys.modules['yaml'] = None\n"
            "import flashdapo.config, flashdapo.kernels, flashdapo.kernels.gpus, flashdapo.kernels.cost\n"
            "assert sys.modules['tyro'] is None and sys.modules['yaml'] is None\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

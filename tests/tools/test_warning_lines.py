"""Warnings in one line: flashdapo's warnings print `flashdapo: warning: ...` once (repeats counted at the end),
go into the run's warnings.log, and become one error line under -W error or logging.warnings_as_errors."""

import io
import warnings
from types import SimpleNamespace

import pytest

from flashdapo.__main__ import main as cli
from flashdapo.errors import user_error_line
from flashdapo.rollout.vllm_platform import warn_if_untested
from flashdapo.tools.warning_lines import WarningAsError, attach_run, showing_warnings
from flashdapo.trainer.observe.logprob_check import warn_logprob_mismatch
from tests.helpers.runs import TINY


def test_a_training_warning_prints_one_line_once_and_its_repeats_at_the_end(tmp_path, capsys):
    # An untrained model (no warm-up) answers wrong: no group is informative, every step warns.
    run_dir = tmp_path / "run"
    assert cli(["train", *TINY, "--model.toy.sft-steps", "0", "--algorithm.dynamic-sampling", "true",
                "--algorithm.max-gen-batches", "1", "--algorithm.on-max-gen-batches", "continue",
                "--trainer.total-steps", "2", "--checkpoint.save-every", "0", "--checkpoint.export-hf", "False",
                "--logging.run-dir", str(run_dir)]) == 0
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if "warning" in line.lower()]
    assert len(lines) == 2, err
    assert lines[0].startswith("flashdapo: warning: step 1: dynamic sampling found 0 informative groups")
    assert lines[1].startswith("flashdapo: warning: came 1 more times (numbers aside), not printed again: step 1:")
    assert not [line for line in err if "UserWarning" in line or "loop.py" in line or "collect_groups" in line]
    logged = (run_dir / "warnings.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in logged] == lines


def test_repeats_with_other_numbers_print_once_and_another_warning_prints_too(tmp_path):
    stream = io.StringIO()
    with showing_warnings(stream):
        attach_run(tmp_path / "warnings.log", 1, 2, False)
        for mean in (0.5, 0.25, 0.125):
            warn_logprob_mismatch(mean, 1.0, 0.1)
        warn_if_untested(SimpleNamespace(__version__="0.99.0"))  # its stacklevel points outside flashdapo
        during = stream.getvalue().splitlines()
    assert len(during) == 2 and during[0].startswith("flashdapo: warning: mean |logp_engine - logp_trainer| = 0.5000")
    assert during[1].startswith("flashdapo: warning: vLLM 0.99.0 is installed; the engine was checked against")
    after = stream.getvalue().splitlines()
    assert len(after) == 3 and after[2].startswith(
        "flashdapo: warning: came 2 more times (numbers aside), not printed again: mean |logp_engine - logp_trainer| "
        "= 0.5000 (max 1.0000)") and after[2].endswith("...")
    logged = (tmp_path / "warnings.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in logged] == [f"[rank 1] {line}" for line in after]


def test_other_packages_warnings_go_to_pythons_display():
    stream = io.StringIO()
    with pytest.warns(UserWarning, match="from elsewhere") as shown, showing_warnings(stream):
        warnings.warn_explicit("from elsewhere", UserWarning, "/site-packages/pkg/mod.py", 7, module="pkg.mod")
    assert stream.getvalue() == "" and shown[0].filename == "/site-packages/pkg/mod.py"


def test_warnings_as_errors_and_w_error_are_one_error_line():
    with showing_warnings(io.StringIO()), pytest.raises(WarningAsError) as raised:
        attach_run(None, 0, 1, True)
        warn_logprob_mismatch(0.5, 1.0, 0.1)
    assert user_error_line(raised.value).startswith(
        "flashdapo: error: warning treated as an error (logging.warnings_as_errors): mean |logp_engine - "
        "logp_trainer| = 0.5000 (max 1.0000) exceeds rollout.logprob_check_threshold=0.1.")
    with warnings.catch_warnings(), pytest.raises(UserWarning) as raised:  # python -W error
        warnings.simplefilter("error")
        warn_logprob_mismatch(0.5, 1.0, 0.1)
    line = user_error_line(raised.value)
    assert line.startswith("flashdapo: error: warning treated as an error: mean |logp_engine") and "\n" not in line

"""metrics.jsonl read back on resume: a torn last line (a crash mid-write) is dropped with a warning."""

import json

import pytest

from flashdapo.trainer.metrics import MetricsError, MetricsLogger


def _logger(run_dir):
    return MetricsLogger(run_dir, enabled=True, tensorboard=False, wandb=False, wandb_project="", progress=False,
                         total_steps=3, config_dict={})


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, capsys):
    records = [{"step": 1, "x": 0.5}, {"step": 2, "x": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "x": 0.1')
    logger = _logger(tmp_path)
    assert logger.history == records
    assert "dropping the torn last line 3" in capsys.readouterr().out
    logger.truncate_after(2)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [json.dumps(r) for r in records]


def test_a_damaged_middle_line_names_the_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl: line 2 is not JSON"):
        _logger(tmp_path)

"""metrics.jsonl read back on resume: a torn last line (a crash mid-write) is dropped with a warning."""

import json

import pytest

from flashdapo.trainer.observe.sinks import MetricsError, MetricsLogger


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


def test_wandb_gets_the_configured_entity_run_name_tags_and_mode(tmp_path, monkeypatch):
    import sys
    import types

    from flashdapo.config import merge, preset
    from flashdapo.trainer.observe.sinks import WandbRun

    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace(finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logging_cfg = merge(preset("toy"), {"logging": {"wandb": True, "wandb_project": "p", "wandb_entity": "team",
                                                    "wandb_run_name": "r1", "wandb_tags": ["a", "b"],
                                                    "wandb_mode": "offline"}}).logging
    MetricsLogger(tmp_path, True, False, True, "p", False, 3, {"x": 1}, WandbRun.from_config(logging_cfg)).close()
    assert calls == [{"project": "p", "entity": "team", "name": "r1", "tags": ["a", "b"], "mode": "offline",
                      "dir": str(tmp_path), "config": {"x": 1}}]
    calls.clear()
    MetricsLogger(tmp_path, True, False, True, "p", False, 3, {}, WandbRun.from_config(preset("toy").logging)).close()
    assert calls[0]["entity"] is None and calls[0]["name"] == tmp_path.name and calls[0]["mode"] == "online"


def test_wandb_missing_is_an_error_not_a_warning(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(MetricsError, match="logging.wandb: true needs the wandb package"):
        MetricsLogger(tmp_path, True, False, True, "p", False, 3, {})


def test_a_failed_metrics_write_warns_once_and_the_file_is_whole_again_after(tmp_path, monkeypatch, capsys):
    import errno
    import pathlib

    logger = _logger(tmp_path)
    logger.log({"step": 1, "x": 1.0})
    real_open, full = pathlib.Path.open, {"on": True}

    def open_on_a_full_disk(self, mode="r", *args, **kwargs):
        if full["on"] and self.name.startswith("metrics.jsonl") and mode != "r":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_on_a_full_disk)
    logger.log({"step": 2, "x": 2.0})
    logger.log({"step": 3, "x": 3.0})
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning: cannot write" in line]
    assert len(warnings) == 1 and "metrics.jsonl" in warnings[0] and "No space left" in warnings[0]
    full["on"] = False
    logger.log({"step": 4, "x": 4.0})
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_plot_that_cannot_be_written_never_stops_training(tmp_path, monkeypatch, capsys):
    import errno

    from flashdapo.trainer.loop import train
    from flashdapo.trainer.observe import sinks as metrics
    from tests.helpers.runs import tiny_config

    def full_disk(history, path, title):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(metrics, "plot_dynamics", full_disk)
    train(tiny_config(tmp_path, trainer={"total_steps": 3, "val_every": 1}, checkpoint={"export_hf": False}))
    out = capsys.readouterr().out
    assert out.count("warning: cannot write") == 1 and "training_dynamics.png" in out
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]

"""A long step says where it is: the heartbeat line names the running stage, its time and the stages done."""

import time

import torch

from flashdapo.distributed.heartbeat import heartbeat, heartbeat_line
from flashdapo.profiling import StageTimer


def test_heartbeat_line_names_the_innermost_running_stage_and_the_finished_ones():
    timer = StageTimer(torch.device("cpu"))
    with timer("step"):
        with timer("gen"):
            pass
        timer.seconds["gen"] = 40.2
        with timer("update_actor"):
            now = time.perf_counter()
            step_start, stage_start = timer.running[0][1], timer.running[1][1]
            line = heartbeat_line(7, timer, now + 61)
    assert line == (f"flashdapo: step 7: in update_actor for {now + 61 - stage_start:.0f} s (gen 40 s done; "
                    f"step {now + 61 - step_start:.0f} s so far)")
    assert timer.running == []


def test_heartbeat_prints_during_a_long_block_and_not_after_a_short_one(capsys):
    timer = StageTimer(torch.device("cpu"))
    with heartbeat(3, timer, every_s=0.05, enabled=True), timer("step"), timer("gen"):
        time.sleep(0.3)
    beats = [line for line in capsys.readouterr().out.splitlines() if line.startswith("flashdapo: step 3: in gen for")]
    assert len(beats) >= 2, beats
    with heartbeat(4, timer, every_s=5.0, enabled=True), timer("step"):
        time.sleep(0.05)
    with heartbeat(5, timer, every_s=0.01, enabled=False), timer("step"):
        time.sleep(0.1)
    assert capsys.readouterr().out == ""


def test_a_heartbeat_interval_below_a_second_is_refused_in_one_line():
    """0.001 s printed ~1,900 lines in two steps; the bound is 1 s (0 still turns it off)."""
    import pytest

    from flashdapo.config import ConfigError, merge, preset

    with pytest.raises(ConfigError, match=r"^logging.heartbeat_s: expected 0 \(never\) or at least 1 seconds, got "
                                          r"0.001$"):
        merge(preset("toy"), {"logging": {"heartbeat_s": 0.001}})
    for allowed in (0.0, 1.0, 60.0):
        assert merge(preset("toy"), {"logging": {"heartbeat_s": allowed}}).logging.heartbeat_s == allowed

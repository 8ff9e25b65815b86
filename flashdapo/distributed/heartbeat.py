"""A line from inside a long step: which stage it is in and for how long, so a 20-minute generation does not
look like a hang. A daemon thread on rank 0 reads the step's stage timer; it prints nothing for steps shorter
than `logging.heartbeat_s`."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class StageClock(Protocol):
    """What the heartbeat reads of a step's stage timer (profiling/stages.py's StageTimer): the stages running
    now with their start times, outermost first, and the seconds of the finished ones."""

    running: list[tuple[str, float]]
    seconds: dict[str, float]


def heartbeat_line(step: int, timer: StageClock, now: float) -> str:
    """'step 7: in update_actor for 61 s (gen 40 s, reward 2 s done; step 103 s so far)'."""
    running = [(name, start) for name, start in timer.running if name != "step"]
    step_start = next((start for name, start in timer.running if name == "step"), now)
    where = f"in {running[-1][0]} for {now - running[-1][1]:.0f} s" if running else "between stages"
    done = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in timer.seconds.items() if name != "step")
    done = f"{done} done; " if done else ""
    return f"flashdapo: step {step}: {where} ({done}step {now - step_start:.0f} s so far)"


@contextmanager
def heartbeat(step: int, timer: StageClock, every_s: float, enabled: bool) -> Iterator[None]:
    """Print `heartbeat_line` every `every_s` seconds while the block runs (nothing if it ends sooner)."""
    if not enabled or every_s <= 0:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            print(heartbeat_line(step, timer, time.perf_counter()), file=sys.stdout, flush=True)

    thread = threading.Thread(target=beat, name="flashdapo-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()

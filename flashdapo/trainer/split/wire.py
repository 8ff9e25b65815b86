"""Split placement's batches on the wire: what the rollout side sends the trainer side for each batch, as
bytes.

A batch travels as plain containers (tensors, numbers, strings, lists, dicts) written with `torch.save` and
read with `torch.load(weights_only=True)`, so a peer's bytes never unpickle arbitrary objects. The rollout
side's rank 0 hands the bytes to a sender thread (`Sender`), which announces the batch in the store and sends
it over the control bridge: the main rollout thread goes on generating the next batch meanwhile, and the
trainer side, which polls for the announcement, receives as soon as it is ready.
"""

from __future__ import annotations

import dataclasses
import io
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ...distributed.roles import Bridges
from ..batch import Group
from ..collect.rounds import Collected
from ..collect.streaming import StreamStats


@dataclass
class BatchMessage:
    """One batch from the rollout side: its groups in canonical order and what producing them cost."""

    batch: int
    weights_step: int
    """The trainer step whose weights sampled this batch's fresh groups (the schedule's b - 1 - k)."""
    groups: list[Group]
    """The whole groups to train, in canonical order, as many as the trainer's data-parallel slots can
    share."""
    collected: Collected
    """What the search cost (global over the rollout side), without groups: the trainer deals `groups`."""
    rollout: RolloutFigures = field(default_factory=lambda: RolloutFigures())
    """The rollout side's own figures for this batch: seconds generating, scoring, waiting, loading."""
    stream: StreamStats | None = None
    """The stream's figures (rollout.streaming), else None."""


@dataclass
class RolloutFigures:
    """The rollout side's figures for one batch (the slowest rollout rank's of each)."""

    gen_s: float = 0.0
    reward_s: float = 0.0
    wait_weights_s: float = 0.0
    """Waiting for the batch's weights to arrive."""
    load_s: float = 0.0
    """Loading them into the policy copy (and the engine)."""
    push_check_max: float = 0.0
    """The push check's max |delta log-prob| on loading them (0: not loaded for this batch)."""
    busy_s: float = 0.0
    """The batch's time, its wait for weights excepted."""
    staged_max: float = 0.0
    """The most weight versions staged at once so far."""


def pack(message: BatchMessage) -> bytes:
    """The message as bytes: plain containers only (each part through its own codec)."""
    plain = {
        "batch": message.batch, "weights_step": message.weights_step,
        "collected": message.collected.figures(), "rollout": dataclasses.asdict(message.rollout),
        "stream": dataclasses.asdict(message.stream) if message.stream is not None else None,
        "groups": [g.to_plain() for g in message.groups]
    }
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    return buffer.getvalue()


def unpack(payload: bytes) -> BatchMessage:
    plain: dict[str, Any] = torch.load(io.BytesIO(payload), weights_only=True)
    groups = [Group.from_plain(g) for g in plain["groups"]]
    stream = StreamStats(**plain["stream"]) if plain["stream"] is not None else None
    return BatchMessage(batch=int(plain["batch"]), weights_step=int(plain["weights_step"]), groups=groups,
                        collected=Collected.from_figures(plain["collected"], []),
                        rollout=RolloutFigures(**plain["rollout"]), stream=stream)


def ready_key(batch: int) -> str:
    return f"batch/{batch}/ready"


class Sender:
    """The rollout side's rank 0: sends packed batches to trainer rank 0 in order, from a thread of its
    own."""

    def __init__(self, bridges: Bridges):
        self.bridges = bridges
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="flashdapo-batches", daemon=True)
        self._thread.start()

    def put(self, batch: int, payload: bytes) -> None:
        if self.error is not None:
            raise self.error
        self._queue.put((batch, payload))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            batch, payload = item
            try:
                self.bridges.set(ready_key(batch), str(len(payload)))
                self.bridges.send_bytes(payload, dst=0, tag=batch,
                                        what=f"trainer rank 0 to take batch {batch}")
            except BaseException as err:  # raised on the main thread at the next put / close
                self.error = err
                return

    def close(self) -> None:
        """Wait until every batch is sent."""
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error


__all__ = ["BatchMessage", "Sender", "pack", "ready_key", "unpack"]

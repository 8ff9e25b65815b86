"""Split placement's batches on the wire: what the rollout side sends the trainer side for each batch, as bytes.

A batch travels as plain containers (tensors, numbers, strings, lists, dicts) written with `torch.save` and
read with `torch.load(weights_only=True)`, so a peer's bytes never unpickle arbitrary objects. The rollout
side's rank 0 hands the bytes to a sender thread (`Sender`), which announces the batch in the store and sends
it over the control bridge: the main rollout thread goes on generating the next batch meanwhile, and the
trainer side, which polls for the announcement, receives as soon as it is ready.
"""

from __future__ import annotations

import io
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ...distributed.roles import Bridges
from ..batch import Group


@dataclass
class BatchMessage:
    """One batch from the rollout side: its groups in canonical order and what producing them cost."""

    batch: int
    weights_step: int
    """The trainer step whose weights sampled this batch's fresh groups (the schedule's b - 1 - k)."""
    groups: list[Group]
    """The whole groups to train, in canonical order, as many as the trainer's data-parallel slots can share."""
    collected: dict[str, float]
    """Collected's scalar fields (global over the rollout side): rounds, groups generated/kept, gen_acc, ..."""
    rollout: dict[str, float] = field(default_factory=dict)
    """The rollout side's own figures for this batch: seconds generating, scoring, waiting, loading."""
    stream: dict[str, int] | None = None
    """StreamStats fields (rollout.streaming), else None."""


_GROUP_FIELDS = ("prompt", "responses", "scores", "acc", "truncated", "sampler_logprobs", "origin", "versions")


def pack(message: BatchMessage) -> bytes:
    plain = {"batch": message.batch, "weights_step": message.weights_step, "collected": message.collected,
             "rollout": message.rollout, "stream": message.stream,
             "groups": [{f: (list(g.origin) if f == "origin" else getattr(g, f)) for f in _GROUP_FIELDS}
                        for g in message.groups]}
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    return buffer.getvalue()


def unpack(payload: bytes) -> BatchMessage:
    plain: dict[str, Any] = torch.load(io.BytesIO(payload), weights_only=True)
    groups = [Group(**{**g, "origin": tuple(g["origin"])}) for g in plain["groups"]]
    return BatchMessage(batch=int(plain["batch"]), weights_step=int(plain["weights_step"]), groups=groups,
                        collected=plain["collected"], rollout=plain["rollout"], stream=plain["stream"])


def ready_key(batch: int) -> str:
    return f"batch/{batch}/ready"


class Sender:
    """The rollout side's rank 0: sends packed batches to trainer rank 0 in order, from a thread of its own."""

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
                self.bridges.send_bytes(payload, dst=0, tag=batch)
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

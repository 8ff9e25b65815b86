"""Sequence-parallel ranks as threads of one process, for tests of the Ulysses all-to-alls without a process group."""

import threading

import torch


class ThreadGroup:
    """sp ranks as threads of one process: rank r sends chunk j of its tensor to rank j."""

    def __init__(self, size: int):
        self.size, self.barrier, self.sent = size, threading.Barrier(size, timeout=60), [None] * size

    def all_to_all(self, chunks: torch.Tensor, rank: int) -> torch.Tensor:
        self.sent[rank] = chunks
        self.barrier.wait()
        received = torch.stack([self.sent[source][rank] for source in range(self.size)])
        self.barrier.wait()
        return received

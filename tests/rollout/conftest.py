"""Rollout tests' fixtures."""

import pytest
import torch


@pytest.fixture
def torchrun_env(monkeypatch):
    """Every test starts as a torchrun rank 0 whose thread count and RNGs the double may change."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)

"""Intra-op thread choice: one thread for tiny models, every allowed CPU for larger ones, the environment wins."""

import torch

from flashdapo.tools.threads import SMALL_MODEL_PARAMS, available_cpus, choose_threads, configure_threads


def test_choose_threads_by_model_size():
    assert choose_threads(117_376, cpus=8) == 1  # the toy model
    assert choose_threads(SMALL_MODEL_PARAMS - 1, cpus=8) == 1
    assert choose_threads(SMALL_MODEL_PARAMS, cpus=8) == 8
    assert choose_threads(300_000_000, cpus=2) == 2
    assert choose_threads(300_000_000, cpus=0) == 1


def test_configure_threads_sets_torch_and_respects_the_environment(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert configure_threads(10_000, torch.device("cpu")) == 1 and torch.get_num_threads() == 1
        assert configure_threads(10**9, torch.device("cpu")) == available_cpus() == torch.get_num_threads()
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert configure_threads(10**9, torch.device("cpu")) is None and torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert configure_threads(10**9, torch.device("cuda")) is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)

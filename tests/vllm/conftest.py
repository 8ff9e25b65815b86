"""Real-vLLM tests' fixtures."""

import pytest

from tests.vllm.toy import toy_export, toy_train_file


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tied and an untied toy export (tests/vllm/toy.py) with the train.jsonl their runs train on; one pair
    per test module."""
    root = tmp_path_factory.mktemp("vllm_toy")
    toy_train_file(root / "train.jsonl")  # beside the exports: train() passes it (a model directory needs data)
    return {"tied": toy_export(root / "tied"), "untied": toy_export(root / "untied", tied=False)}

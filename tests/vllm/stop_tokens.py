"""Real vLLM (its CPU build here) on a Llama-3-style directory whose generation_config.json lists only
`<|end_of_text|>` while the chat template ends turns in `<|eot_id|>`, and whose weights always emit `<|eot_id|>`.

`python -m tests.vllm.stop_tokens OUT_JSON CASE ROOT` runs one engine in a process of its own (vLLM's shutdown
destroys the process group): CASE "factory" builds it as flashdapo does (rollout.build_engine: the stop set as
SamplingParams.stop_token_ids), "bare" without stop ids (vLLM's own eos handling only).
tests/vllm/test_vllm_stop_tokens.py reads what it writes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers.llama3_dir import END_OF_TEXT, EOT, llama3_tokenizer


def eot_model(root: Path) -> LlamaForCausalLM:
    """Save the directory; the model (heads of 32, as vLLM's CPU attention takes) whose every next token is
    `<|eot_id|>`: no attention or MLP output, embedding column 0 = 1, the head reads only that column."""
    tok = llama3_tokenizer()
    eos, eot = tok.convert_tokens_to_ids(END_OF_TEXT), tok.convert_tokens_to_ids(EOT)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=tok.bos_token_id, eos_token_id=eos, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[eot, 0] = 100.0
    model.save_pretrained(root)
    tok.save_pretrained(root)
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": eos}))
    return model


def one(out_path: str, case: str, root: str) -> None:
    import torch.distributed as dist

    from flashdapo.config import RolloutConfig
    from flashdapo.models.weights import iter_full_state_dict
    from flashdapo.rollout.base import SamplingParams
    from flashdapo.rollout.factory import build_engine, cpu_env
    from flashdapo.rollout.vllm_engine import VLLMEngine
    from flashdapo.tokenizer import load_tokenizer
    from tests.vllm.toy import KV_GIB

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    path = Path(root) / case
    path.mkdir(parents=True, exist_ok=True)
    model = eot_model(path)
    rollout = RolloutConfig(engine="vllm", kv_cache_gib=KV_GIB)
    if case == "factory":
        engine = build_engine(rollout, cpu_env(), load_tokenizer(str(path)), model_path=str(path), dtype="float32",
                              max_model_len=64)
    else:
        engine = VLLMEngine(rollout, str(path), rank=0, world_size=1, dtype="float32", max_model_len=64)
    engine.update_weights(iter_full_state_dict(model))
    rollouts = engine.generate([[0, 2, 3]], SamplingParams(n=2, max_new_tokens=6, seed=1))
    result = {"stop_token_ids": list(engine.stop_token_ids), "responses": [r.tolist() for r in rollouts.response_ids],
              "truncated": rollouts.truncated.tolist()}
    engine.shutdown()
    Path(out_path).write_text(json.dumps(result))


def run(case: str, root: Path) -> dict:
    out = root / f"{case}.json"
    subprocess.run([sys.executable, "-m", "tests.vllm.stop_tokens", str(out), case, str(root)], check=True,
                   timeout=900)
    return json.loads(out.read_text())


if __name__ == "__main__":
    one(*sys.argv[1:4])

"""Families on real vLLM (its CPU build here), one after the other in one process (vLLM is imported once;
an engine's shutdown destroys the process group, which is made again for the next family):
`python tests/models/scripts/family_vllm.py ROOT OUT_JSON ROWS_JSON`, ROWS_JSON [[MODEL_TYPE, CONFIG_OVERRIDES],
...]. For each row, a tiny model of the family (tests/helpers/family_configs.py, vLLM's size: head size
32) is saved under ROOT with the toy tokenizer; vLLM starts on it in fp32, then takes two pushes from the
policy, each checked by the trainer's push check (sync/check.py): the policy's weights
(perturbed from the saved ones, so that a push that loads nothing fails), and the same with decoder layer 1
holding another initialization (must fail, naming layers.1: the family's push-check groups exist on both
sides). Writes {MODEL_TYPE: {"started", "pushes": [{"case", "result", "max", "message"}], "error"}}; a row's
error is its own, the next row runs."""

import copy
import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from flashdapo.config import RolloutConfig, ToyTaskConfig
from flashdapo.models.policy import PolicyModel
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.rollout.vllm_engine import VLLMEngine
from flashdapo.sync.check import PushCheck, PushMismatchError
from flashdapo.tasks.toy import build_toy_tokenizer
from tests.helpers.family_configs import ATTENTION, VOCAB, family_config

KV_GIB = 0.03125


def model(model_type: str, seed: int, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family_config(model_type, vllm=True, **overrides), attn_implementation=ATTENTION.get(model_type, "sdpa"),
                                            dtype=torch.float32)


def main(model_type: str, root: Path, out: dict, overrides: dict) -> None:
    tokenizer = build_toy_tokenizer(ToyTaskConfig())
    saved = model(model_type, 0, **overrides)
    saved.save_pretrained(root)
    tokenizer.save_pretrained(root)
    trainer = copy.deepcopy(saved)
    with torch.no_grad():  # the weights the push must bring: not those vLLM loaded from disk
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # Built before vLLM starts: its Transformers backend (OLMo 2/3) decorates transformers' model classes in
    # this process, which then build only inside vLLM's own config context.
    wrong = copy.deepcopy(trainer)
    wrong.model.layers[1].load_state_dict(model(model_type, 1, **overrides).model.layers[1].state_dict())
    policy = PolicyModel(trainer, "sdpa", "torch", temperature=1.0)
    check = PushCheck(policy, torch.device("cpu"), VOCAB, out["log"].append, tokenizer_size=len(tokenizer))
    engine = VLLMEngine(RolloutConfig(engine="vllm", kv_cache_gib=KV_GIB), str(root), rank=0, world_size=1,
                        dtype="float32", max_model_len=64, seed=0, verify_push=check)
    out["started"] = engine.started_line
    for case, pushed in (("policy", trainer), ("layers.1 from another init", wrong)):
        try:
            engine.update_weights(iter_full_state_dict(pushed))
            result, message = "pass", ""
        except PushMismatchError as err:
            result, message = "fail", str(err)
        out["pushes"].append({"case": case, "result": result, "max": check.last_max, "message": message})
    engine.shutdown()


def _process_group() -> None:
    """A one-rank gloo group for the next engine (the last engine's shutdown destroyed the previous one)."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)


if __name__ == "__main__":
    root, out_path, rows = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    results: dict = {}
    for model_type, overrides in rows:
        _process_group()
        result: dict = {"started": None, "pushes": [], "log": [], "error": None}
        try:
            main(model_type, root / model_type, result, overrides)
        except Exception as err:  # the row reports it
            result["error"] = (f"{type(err).__name__}: {' '.join(str(err).split())[:2000]}\n"
                               f"{traceback.format_exc()[-4000:]}")
        results[model_type] = result
        out_path.write_text(json.dumps(results))  # after every row: a crash keeps the rows before it

"""torchrun script (2 ranks): the push check's fp32 reference (`reference_logprobs`) of FSDP2-sharded policies (each
decoder block and the root sharded, activation checkpointing on, as a run has them) against the one-process
reference each rank computes on its unsharded copy first: Gemma 4 (per-layer inputs gathered up front, layer
scalars) and DeepSeek-V3 (MLA, MoE, a persistent routing bias). argv: OUT_DIR; rank 0 writes OUT_DIR/results.pt:
per model type {"alone", "ranks": [each rank's log-probs]} or {"error": line}."""

import copy
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from flashdapo.config import ModelConfig, TrainerConfig
from flashdapo.distributed.mesh import init_distributed, shutdown
from flashdapo.models.parallelize import parallelize
from flashdapo.models.policy import PolicyModel
from flashdapo.sync.check import reference_logprobs
from tests.helpers.family_configs import family_config
from tests.helpers.moe import tiny_deepseek

out = Path(sys.argv[1])
env = init_distributed("cpu")
CPU = torch.device("cpu")


def tiny(model_type: str) -> torch.nn.Module:
    if model_type == "deepseek_v3":
        model = tiny_deepseek(dtype=torch.float32)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config(model_type), dtype=torch.float32)
    with torch.no_grad():  # persistent buffers at values bf16 rounds
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    buffer.fill_(1.3)
    return model


def family(model_type: str) -> dict:
    model = tiny(model_type)
    sequences = torch.randint(3, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0)).tolist()
    alone = torch.stack(reference_logprobs(copy.deepcopy(model), sequences, CPU, torch.bfloat16))
    policy = parallelize(PolicyModel(model, "eager", "naive", 1.0), env,
                         ModelConfig(attn_implementation="eager", gradient_checkpointing=True), TrainerConfig())
    mine = torch.stack(reference_logprobs(policy.hf, sequences, CPU, torch.bfloat16))
    gathered = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(gathered, mine)
    return {"alone": alone, "ranks": gathered}


results = {}
for model_type in ("gemma4_text", "deepseek_v3"):
    try:
        results[model_type] = family(model_type)
    except Exception as err:  # noqa: BLE001 - reported to the test, which names it
        traceback.print_exc()
        results[model_type] = {"error": f"{type(err).__name__}: {err}"}
if env.rank == 0:
    torch.save(results, out / "results.pt")
shutdown()

"""torchrun script: each rank's local elements of every parameter of a tiny Qwen3-MoE after the trainer's
own `parallelize` with trainer.expert_parallel E (what `flashdapo plan` counts as that rank's shard).
argv: OUT_DIR then cases NUM_EXPERTS:E ... Writes OUT_DIR/<experts>x<E>.rank<r>.json: {HF parameter name:
local element count}."""

import json
import sys
from pathlib import Path

from torch.distributed.tensor import DTensor

from flashdapo.config import merge, toy
from flashdapo.distributed.mesh import init_distributed, shutdown
from flashdapo.models.parallelize import parallelize
from flashdapo.models.policy import PolicyModel
from tests.helpers.moe import tiny_moe

SHAPE = {"vocab_size": 37, "mlp_only_layers": [1], "moe_intermediate_size": 5}
"""A dense second layer and odd widths: uneven chunks count on every rank."""

out = Path(sys.argv[1])
env = init_distributed("cpu")
try:
    for case in sys.argv[2:]:
        experts, ep = (int(v) for v in case.split(":"))
        cfg = merge(toy(), {"trainer": {"expert_parallel": ep}})
        model = tiny_moe(num_experts=experts, **SHAPE)
        policy = parallelize(PolicyModel(model, "sdpa", "torch", 1.0), env, cfg.model, cfg.trainer)
        local = {name: (p.to_local() if isinstance(p, DTensor) else p).numel()
                 for name, p in policy.hf.named_parameters()}
        (out / f"{experts}x{ep}.rank{env.rank}.json").write_text(json.dumps(local))
finally:
    shutdown()

"""torchrun script: load an HF checkpoint into the sharded policy; rank 0 writes the gathered weights and
the logits of a fixed input (which also exercises the broadcast rotary buffers)."""

import sys
from pathlib import Path

import torch

from flashdapo.config import merge, toy
from flashdapo.distributed.mesh import init_distributed, shutdown
from flashdapo.models.loading import load_sharded_policy
from flashdapo.models.weights import iter_full_state_dict

model_dir, out = sys.argv[1], Path(sys.argv[2])
env = init_distributed("cpu")
policy = load_sharded_policy(merge(toy(), {"model": {"path": model_dir}}), env)
params = {name: t.clone() for name, t in iter_full_state_dict(policy.hf)}
with torch.no_grad():
    logits = policy(input_ids=torch.arange(3, 15).reshape(2, 6)).logits
if env.is_main:
    torch.save({"params": params, "logits": logits}, out / "loaded.pt")
shutdown()

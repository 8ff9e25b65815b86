"""One round of 8 prompts of 78 tokens x 16 samples (128 sequences, 9,984 prompt tokens: more than one engine
step's default budget of 8,192) on the co-located engine: `python many_long_prompts.py MODEL_DIR`. Prints
'sampled N responses' on success, else the error's one line (as `flashdapo` would) and exits 1."""

import sys
from pathlib import Path

from flashdapo.config import RolloutConfig
from flashdapo.distributed.mesh import init_distributed, shutdown
from flashdapo.errors import user_error_line
from flashdapo.rollout.base import SamplingParams
from flashdapo.rollout.vllm_engine import VLLMEngine
from tests.vllm.toy import KV_GIB

model = Path(sys.argv[1])
init_distributed("cpu")
engine = VLLMEngine(RolloutConfig(engine="vllm", kv_cache_gib=KV_GIB), str(model), rank=0, world_size=1,
                    dtype="float32", max_model_len=78 + 16, dummy_weights=False,
                    error_log=model.parent / "vllm-error.rank0.log")
try:
    prompts = [[5 + (i + j) % 20 for j in range(78)] for i in range(8)]
    rollouts = engine.generate(prompts, SamplingParams(n=16, max_new_tokens=16, seed=3))
    print(f"sampled {len(rollouts)} responses", flush=True)
except Exception as err:
    print(user_error_line(err) or repr(err), flush=True)
    sys.exit(1)
finally:
    engine.shutdown()
    shutdown()

"""Streams on real vLLM, in a process of their own (vLLM's CPU worker changes process-wide state):
`python -m tests.vllm.stream_script MODEL_DIR OUT_JSON`. Writes what every scenario returned;
tests/vllm/test_vllm_stream.py checks it.

One rank, a TP group of one, `max_num_seqs=4` so that requests wait for room in the batch.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from flashdapo.config import RolloutConfig
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.rollout.base import Request, SamplingParams
from flashdapo.rollout.vllm_engine import VLLMEngine
from flashdapo.rollout.vllm_invariant import install_kernel_logprobs
from flashdapo.seeds import derive_seed
from tests.vllm.toy import KV_GIB

SEED = 31
PROMPTS = [[10 + i, 40 + 3 * i, 70 + i, 100 + 2 * i, 130 + i][: 3 + i % 3] for i in range(8)]
"""Shorter than a KV block, so that no scenario reuses another's prompt KV from the prefix cache."""
UNIFORM = 12
VARIED = [6 + (5 * i) % 14 for i in range(8)]
ABORT_AFTER = 7
SAMPLING = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=UNIFORM, seed=SEED)


def record(completion, step: int | None = None) -> dict:
    return {"key": completion.key, "tokens": completion.tokens.tolist(), "logprobs": completion.logprobs.tolist(),
            "finished": completion.finished, "truncated": completion.truncated, "step": step,
            "dtypes": [str(completion.tokens.dtype), str(completion.logprobs.dtype)]}


def requests(budgets: list[int], keys: range | list[int] | None = None) -> list[Request]:
    keys = range(len(PROMPTS)) if keys is None else keys
    return [Request(key=k, prompt=tuple(PROMPTS[k]), max_new_tokens=budgets[k], seed=derive_seed(SEED, 0, k))
            for k in keys]


def drain(engine: VLLMEngine, first_step: int = 0) -> list[dict]:
    out, step = [], first_step
    while engine.pending():
        out += [record(c, step) for c in engine.step()]
        step += 1
        assert step < 500, "the stream never drained"
    return out


def staggered(engine: VLLMEngine) -> list[dict]:
    """Half the requests, three steps, the other half (a refill mid-stream), to the end."""
    engine.open_stream(SAMPLING)
    engine.submit(requests(VARIED, range(4)))
    out = [record(c, step) for step in range(3) for c in engine.step()]
    engine.submit(requests(VARIED, range(4, 8)))
    out += drain(engine, 3)
    assert engine.abort() == []
    return out


def marker(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """A stand-in log-prob that names its row's token: -(token + temperature)."""
    return -(tokens.float() + temperature)


def main(model_dir: str, out_path: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    engine = VLLMEngine(RolloutConfig(engine="vllm", kv_cache_gib=KV_GIB), model_dir, rank=0, world_size=1,
                        dtype="float32", max_model_len=64, seed=0, dummy_weights=False, max_num_seqs=4)
    out: dict = {"started": engine.started_line}
    reference = engine.generate(PROMPTS, SAMPLING)
    out["generate"] = [{"tokens": r.tolist(), "logprobs": lp.tolist(), "truncated": bool(t)}
                       for r, lp, t in zip(reference.response_ids, reference.logprobs, reference.truncated,
                                           strict=True)]
    engine.open_stream(SAMPLING)
    engine.submit(requests([UNIFORM] * 8))
    out["uniform"] = drain(engine)
    engine.abort()
    out["staggered"] = [staggered(engine), staggered(engine)]
    engine.open_stream(SAMPLING)
    engine.submit(requests(VARIED))
    out["unaborted"] = drain(engine)
    engine.abort()

    engine.open_stream(SAMPLING)
    engine.submit(requests(VARIED))
    out["before_abort"] = [record(c, step) for step in range(ABORT_AFTER) for c in engine.step()]
    out["partials"] = [record(c) for c in engine.abort()]
    out["unfinished_after_abort"] = engine.llm.llm_engine.has_unfinished_requests()
    out["idle_step"] = len(engine.llm.llm_engine.step())  # vLLM stepped with nothing to do

    engine.open_stream(SAMPLING)  # the partials resume, prefilled with what they sampled
    resumed = [Request(key=p["key"], prompt=tuple(PROMPTS[p["key"]]), prefix=tuple(p["tokens"]),
                       max_new_tokens=VARIED[p["key"]] - len(p["tokens"]), seed=derive_seed(SEED, 1, p["key"]))
               for p in out["partials"]]
    engine.submit(resumed)
    out["resumed"] = drain(engine)
    engine.abort()
    by_key = {c["key"]: c for c in out["resumed"]}
    sequences = [list(r.prompt) + list(r.prefix) + by_key[r.key]["tokens"] for r in resumed]
    out["resumed_scored"] = [lp[-len(by_key[r.key]["tokens"]):].tolist()
                             for r, lp in zip(resumed, engine.score(sequences), strict=True)]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine.sleep()  # a no-op on the CPU build; then a push, which resets the prefix cache vLLM used
    engine.wake(lambda dtype: iter_full_state_dict(hf, dtype=dtype))
    again = engine.generate(PROMPTS, SAMPLING)
    out["generate_after_push"] = [r.tolist() for r in again.response_ids]
    out["logprobs_after_push"] = [lp.tolist() for lp in again.logprobs]

    # trainer.batch_invariant's hook (rollout/vllm_invariant.py): the sampled log-probs from flashdapo's kernel
    # on the rows vLLM sampled from, then from a marker that shows which token each row holds.
    engine.llm.collective_rpc(install_kernel_logprobs)
    kernel = engine.generate(PROMPTS, SAMPLING)
    out["kernel"] = [{"tokens": r.tolist(), "logprobs": lp.tolist()}
                     for r, lp in zip(kernel.response_ids, kernel.logprobs, strict=True)]
    engine.llm.collective_rpc(functools.partial(install_kernel_logprobs, logprob_fn=marker))
    out["marked"] = [lp.tolist() for lp in engine.generate(PROMPTS, SAMPLING).logprobs]
    engine.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Run `flashdapo train ARGS` (LoRA on vLLM) and, when its engine shuts down at the run's end, try the LoRA push
check's cases on the trained policy and that same engine (no second vLLM start), writing what they gave to OUT:

    python lora_push_cases.py OUT ARGS...        (under torchrun, one rank)

The cases, in order:
- stale: the engine holds the adapters of the run's last push (before its last update), the trainer the updated
  ones: the check alone (no push) must fail, however small the update (the adapters' digest);
- applied: the trainer's B drawn large and its trained norms scaled, pushed: passes, with the base model's
  log-probs (vLLM without the adapter) far from the trainer's, so that the agreement says the adapter is applied;
- norms lost: the norms scaled again and B kept, a push whose norms never reach vLLM's base (push_norms a
  no-op): the log-probs fail it;
- not applied: vLLM's LoRA slots emptied behind the engine (the digest still matches): the log-probs fail it;
- lost push: B drawn again, a wake whose push never reaches vLLM (push_adapters hands back the last push): fails;
- short stream: a wake whose adapter stream lacks one module's lora_B: refused naming it;
- again: an intact wake after all that: passes;
- nudged: every B of the trainer moved by 1e-6 after that push (an update far below the log-prob tolerance): the
  check alone fails it (the digest).
OUT also holds every adapter push of the run (bytes, tensors, seconds) and how often the full-weight push ran.
"""

import collections
import json
import sys
import traceback
from pathlib import Path

import torch

import flashdapo.rollout.vllm_engine as vllm_engine
import flashdapo.sync.vllm as vllm_sync
from flashdapo.__main__ import main
from flashdapo.rollout.vllm_outputs import sampled_logprobs
from flashdapo.sync import policy_weights
from flashdapo.sync.check import PushMismatchError

OUT = Path(sys.argv[1])
record: dict = {"full_pushes": 0, "adapter_pushes": [], "cases": {}}

real_push_weights, real_push_adapters = vllm_engine.push_weights, vllm_engine.push_adapters
real_push_norms = vllm_sync.push_norms


def counted_push_weights(*args, **kwargs):
    record["full_pushes"] += 1
    return real_push_weights(*args, **kwargs)


def recorded_push_adapters(*args, **kwargs):
    push = real_push_adapters(*args, **kwargs)
    record["adapter_pushes"].append({"lora_id": push.lora_id, "tensors": push.tensors, "bytes": push.bytes,
                                     "seconds": push.seconds})
    return push


vllm_engine.push_weights, vllm_engine.push_adapters = counted_push_weights, recorded_push_adapters


def attempt(name: str, run, check) -> None:
    """Run one case: 'pass' or the error's type, the message, the check's last max |delta logp| and what the
    case returns."""
    pushes = check.pushes
    try:
        extra = run() or {}
        result, message = "pass", ""
    except (PushMismatchError, RuntimeError) as err:
        extra, result, message = {}, type(err).__name__, str(err)
    checked = {"max": check.last_max} if check.pushes > pushes else {}
    record["cases"][name] = {"result": result, "message": message, **checked, **extra}


def scale_norms(hf, factor: float) -> None:
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name in hf.adapter_layout.norms:
                (param.to_local() if hasattr(param, "to_local") else param).mul_(factor)


def draw_b(hf, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "lora_B" in name:
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_(torch.randn(local.shape, generator=gen) * 0.05)


def cases(engine) -> None:
    check = engine.verify_push
    policy = check.policy
    weights = policy_weights(policy.hf, "float32")
    versions = iter(range(10_000, 10_100))

    attempt("stale", lambda: check(engine), check)  # its max: the last update's size, seen in log-probs

    def applied():
        draw_b(policy.hf, 1)
        scale_norms(policy.hf, 1.3)
        engine.wake(weights, next(versions))
        params = engine._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = engine.llm.generate([{"prompt_token_ids": s} for s in check.probe], params, use_tqdm=False)
        base = torch.cat([sampled_logprobs(s[1:], o.prompt_logprobs[1:]) for s, o in zip(check.probe, outs)])
        trainer = torch.cat(check.trainer_logprobs(check.probe))
        return {"base_max": (base - trainer).abs().max().item()}

    attempt("applied", applied, check)

    def norms_lost():
        scale_norms(policy.hf, 1.5)
        vllm_sync.push_norms = lambda llm, norms: 0
        try:
            engine.wake(weights, next(versions))
        finally:
            vllm_sync.push_norms = real_push_norms

    attempt("norms_lost", norms_lost, check)
    attempt("norms_again", lambda: engine.wake(weights, next(versions)), check)

    def empty_slots(worker):
        adapters = worker.model_runner.lora_manager._adapter_manager
        index = adapters.lora_index_to_id.index(engine.last_adapter_push.lora_id)
        for module in adapters.modules.values():
            module.reset_lora(index)

    def not_applied():
        engine.llm.collective_rpc(empty_slots)
        check(engine)

    attempt("not_applied", not_applied, check)

    def lost_push():
        draw_b(policy.hf, 2)
        last = engine.last_adapter_push
        vllm_engine.push_adapters = lambda llm, named, layout, lora_id: (collections.deque(named, 0), last)[1]
        try:
            engine.wake(weights, next(versions))
        finally:
            vllm_engine.push_adapters = recorded_push_adapters

    attempt("lost_push", lost_push, check)

    class Short:
        layout = weights.layout

        def adapters(self):
            return ((n, t) for n, t in weights.adapters() if not n.endswith("layers.0.mlp.down_proj.lora_B.weight"))

    attempt("short_stream", lambda: engine.wake(Short(), next(versions)), check)
    attempt("again", lambda: engine.wake(weights, next(versions)), check)

    def nudged():
        with torch.no_grad():
            for name, param in policy.hf.named_parameters():
                if "lora_B" in name:
                    (param.to_local() if hasattr(param, "to_local") else param).add_(1e-6)
        check(engine)

    attempt("nudged", nudged, check)


real_shutdown = vllm_engine.VLLMEngine.shutdown


def shutdown(self) -> None:
    if not record["cases"] and self.last_adapter_push is not None:
        try:
            cases(self)
        except Exception:  # noqa: BLE001 - written down for the test to show
            record["error"] = traceback.format_exc()
        OUT.write_text(json.dumps(record, indent=1))
    real_shutdown(self)


vllm_engine.VLLMEngine.shutdown = shutdown
sys.exit(main(["train", *sys.argv[2:]]))

"""torchrun script (2 ranks): every family of the matrix (tests/helpers/family_configs.py) trained by FSDP2 over
both ranks, once data parallel (each rank its half of the sequences) and once with sequence parallelism 2 (both
ranks one packed row, each holding half of it), next to a one-process reference each rank computes without
collectives, then one AdamW step and an HF export of the sharded policy. argv: OUT_DIR.

Rank 0 writes OUT_DIR/results.pt: per model type either {"error": line} or {"reference", "dp2", "sp2" (None
where the heads do not split in 2, the refusal's line where the family refuses sp): (log-probs of each sequence, gradients of sum(weights * logp) as full
tensors, summed over ranks), "params": the full tensors after the AdamW step}; and OUT_DIR/<model type>/export,
the export of those parameters."""

import copy
import dataclasses
import sys
import traceback
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from flashdapo.config import ModelConfig, ToyTaskConfig, TrainerConfig
from flashdapo.distributed.mesh import SequenceParallelError, init_distributed, shutdown
from flashdapo.models.hf import FAMILIES
from flashdapo.models.packing import use_packed_attention
from flashdapo.models.parallelize import parallelize
from flashdapo.models.policy import PolicyModel, per_token_split
from flashdapo.models.ulysses import heads_fit
from flashdapo.models.weights import hf_name, iter_full_state_dict
from flashdapo.tasks.toy import build_toy_tokenizer
from flashdapo.trainer.state.export import export_hf
from tests.helpers.family_configs import ATTENTION, MATRIX, VOCAB, family_config

out = Path(sys.argv[1])
env = init_distributed("cpu", sequence_parallel=2)
dp_env = dataclasses.replace(env, sequence_parallel=1, sp_group=None)  # the same 2 ranks, data parallel
tokenizer = build_toy_tokenizer(ToyTaskConfig())
TEMPERATURE = 0.7
g = torch.Generator().manual_seed(3)
LENGTHS = [(6, 9), (1, 3), (4, 12), (9, 2)]  # (prompt, response): the packed row of 41 tokens spans both sp shards
prompts = [torch.randint(3, VOCAB, (p,), generator=g) for p, _ in LENGTHS]
responses = [torch.randint(3, VOCAB, (r,), generator=g) for _, r in LENGTHS]
weights = [torch.randn(r, generator=g, dtype=torch.float64) for _, r in LENGTHS]


def dtype_of(model_type: str) -> torch.dtype:
    """float64, but GPT-OSS: transformers' fused experts (grouped mm) take no float64."""
    return torch.float32 if model_type == "gpt_oss" else torch.float64


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double().clone()


def run(policy: PolicyModel, mine: list[int], sp: bool):
    """Log-probs of sequences `mine` (by index) and the gradients of sum(weights * logp) over every rank."""
    batch = policy.token_batch([prompts[i] for i in mine], [responses[i] for i in mine], torch.device("cpu"))
    logp, _ = policy(batch)
    w = torch.cat([weights[i] for i in mine]).to(logp.dtype)
    (logp * batch.local(w)).sum().backward()
    whole = policy.whole_micro_batch(logp.detach(), batch) if sp else logp.detach()
    grads = {hf_name(name): full(p.grad) for name, p in policy.hf.named_parameters()}
    return dict(zip(mine, (lp.double() for lp in per_token_split(whole, batch)))), grads


def family(model_type: str) -> dict:
    torch.manual_seed(0)
    attention = ATTENTION.get(model_type, "sdpa")
    model = AutoModelForCausalLM.from_config(family_config(model_type), attn_implementation=attention,
                                             dtype=dtype_of(model_type)).train()
    copies = [copy.deepcopy(model) for _ in range(2)]
    reference = PolicyModel(model, attention, "naive", TEMPERATURE)
    reference.pack = True
    use_packed_attention(model)
    result = {"reference": run(reference, list(range(len(LENGTHS))), sp=False)}
    model_cfg = ModelConfig(attn_implementation=attention, gradient_checkpointing=True)
    trainer_cfg = TrainerConfig(pack_sequences=True)
    dp = parallelize(PolicyModel(copies[0], attention, "naive", TEMPERATURE), dp_env, model_cfg, trainer_cfg)
    result["dp2"] = run(dp, list(range(env.rank, len(LENGTHS), 2)), sp=False)
    config = copies[1].config
    result["sp2"] = None
    if heads_fit(config.num_attention_heads, config.num_key_value_heads, 2):
        try:  # a family whose layers cannot take sequence shards is refused (one line) before any collective
            sp = parallelize(PolicyModel(copies[1], attention, "naive", TEMPERATURE), env, model_cfg, trainer_cfg)
        except SequenceParallelError as err:
            result["sp2"] = str(err)
        else:
            result["sp2"] = run(sp, list(range(len(LENGTHS))), sp=True)
    # One AdamW step of the data-parallel policy (its gradients: the sum over both ranks), then its export.
    torch.optim.AdamW(dp.parameters(), lr=1e-2).step()
    result["params"] = {name: t.double().clone() for name, t in iter_full_state_dict(dp.hf)}
    export_hf(iter_full_state_dict(dp.hf), dp.hf.config, tokenizer, out / model_type / "export", env.is_main)
    return result


results = {}
for model_type in MATRIX:
    if model_type not in FAMILIES:
        results[model_type] = {"error": f"{model_type} is not in flashdapo.models.hf.FAMILIES"}
        continue
    try:
        results[model_type] = family(model_type)
    except Exception as err:  # one family's failure is its row's, not the others'
        results[model_type] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"}
if env.is_main:
    torch.save(results, out / "results.pt")
shutdown()

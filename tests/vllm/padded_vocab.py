"""Model directories vLLM starts on with dummy weights, whose vocabulary is padded past the tokenizer (as
Qwen2.5's 152064 rows over 151665 ids), for the families flashdapo trains: config.json (with
`architectures`) and a word-level tokenizer of `tokens` ids; the weights are pushed from an HF model of the
same config.

`python -m tests.vllm.padded_vocab OUT_JSON` runs the bf16 push check and the sampling restriction on real
vLLM (its CPU build here) in a process of its own; tests/vllm/test_vllm_padded_vocab.py reads what it writes.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

CONFIGS = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "mistral": MistralConfig}


def family_config(family: str, *, hidden: int, layers: int, vocab: int, tied: bool, init: float = 0.02,
                  head_dim: int = 64) -> PretrainedConfig:
    """A config of `family` with heads of `head_dim` (vLLM's CPU attention takes 32, 64, 80, ...), a quarter
    as many KV heads, and `vocab` rows."""
    heads = hidden // head_dim
    extra = {"head_dim": head_dim} if family == "qwen3" else {}
    extra |= {"sliding_window": None} if family == "mistral" else {}
    return CONFIGS[family](vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 64 * 64,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                           tie_word_embeddings=tied, max_position_embeddings=512, initializer_range=init,
                           bos_token_id=1, eos_token_id=1, pad_token_id=0, **extra)


def word_tokenizer(tokens: int):
    """A word-level tokenizer of `tokens` ids: <pad> 0, <eos> 1, <unk> 2, then w3, w4, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, tokens)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model_dir(path: Path, config: PretrainedConfig, tokens: int) -> Path:
    """config.json with `architectures` and the tokenizer of `tokens` ids (no weights: vLLM loads dummy ones)."""
    path.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    config.architectures = [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                             "mistral": "MistralForCausalLM"}[config.model_type]]
    config.save_pretrained(path)
    word_tokenizer(tokens).save_pretrained(path)
    return path


def hf_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    model.config._attn_implementation = "sdpa"
    return model


# -- the real-vLLM run ------------------------------------------------------------------------------------

FAMILIES = ("qwen2", "qwen3", "llama", "mistral")
HIDDEN, LAYERS, VOCAB, TOKENS = 256, 3, 4160, 4096
"""The test's size (the measurements in docs/vllm.md used hidden 512 and 1024: `main(..., hidden=...)`)."""


def _scale_layer(model: torch.nn.Module, layer: int, factor: float) -> None:
    with torch.no_grad():
        for p in model.model.layers[layer].parameters():
            p.mul_(factor)


def run_family(root: Path, family: str, tied: bool, hidden: int, layers: int, vocab: int, tokens: int) -> dict:
    """One engine: intact push, a decoder layer x1.01, x1.05, a decoder layer holding another initialization
    (a layer the push left stale), intact again."""
    from flashdapo.config import RolloutConfig
    from flashdapo.models.policy import PolicyModel
    from flashdapo.models.weights import iter_full_state_dict
    from flashdapo.rollout.vllm_engine import VLLMEngine
    from flashdapo.sync.check import PushCheck, PushMismatchError
    from tests.vllm.toy import KV_GIB

    config = family_config(family, hidden=hidden, layers=layers, vocab=vocab, tied=tied)
    path = model_dir(root / f"{family}-{'tied' if tied else 'untied'}", config, tokens)
    trainer = hf_model(config).to(torch.bfloat16)
    policy = PolicyModel(trainer, "sdpa", "torch", temperature=1.0)
    lines: list[str] = []
    check = PushCheck(policy, torch.device("cpu"), vocab, lines.append, tokenizer_size=tokens)
    engine = VLLMEngine(RolloutConfig(engine="vllm", kv_cache_gib=KV_GIB), str(path), rank=0, world_size=1,
                        dtype="bfloat16", max_model_len=128, seed=0, verify_push=check)
    out: dict = {"family": family, "tied": tied, "hidden": hidden, "layers": layers, "started": engine.started_line,
                 "banned": [min(engine.banned_token_ids, default=-1), max(engine.banned_token_ids, default=-1)],
                 "probe_max_id": max(max(s) for s in check.probe), "pushes": []}
    middle = layers // 2
    other = hf_model(config, seed=1).to(torch.bfloat16)
    cases: list[tuple[str, Any]] = [
        ("intact", None), (f"layers.{middle} x1.01", lambda m: _scale_layer(m, middle, 1.01)),
        (f"layers.{middle} x1.05", lambda m: _scale_layer(m, middle, 1.05)),
        (f"layers.{middle} from another init", lambda m: m.model.layers[middle].load_state_dict(
            other.model.layers[middle].state_dict())),
        ("intact again", None)]
    for name, change in cases:
        pushed = trainer
        if change is not None:
            pushed = copy.deepcopy(trainer)
            with torch.no_grad():
                change(pushed)
        try:
            engine.update_weights(iter_full_state_dict(pushed))
            result, message = "pass", ""
        except PushMismatchError as err:
            result, message = "fail", str(err)
        out["pushes"].append({"case": name, "result": result, "mean": check.last_mean, "max": check.last_max,
                              "message": message})
    calibration = check.calibration
    out.update(calibration={"mean": calibration.mean, "max": calibration.max, "mean_limit": calibration.mean_limit,
                            "max_limit": calibration.max_limit}, log=lines)
    # Sampling: high temperature over a vocabulary whose padding would otherwise be sampled often.
    rollouts = engine.generate([[5, 6, 7], [8, 9]], _sampling())
    out["sampled"] = sorted({int(t) for r in rollouts.response_ids for t in r})
    out["sampled_count"] = sum(len(r) for r in rollouts.response_ids)
    engine.shutdown()
    return out


def _sampling():
    from flashdapo.rollout.base import SamplingParams

    return SamplingParams(n=16, temperature=2.0, max_new_tokens=32, seed=3)


def padded_head_model(root: Path, tokens: int = 64, vocab: int = 256) -> dict:
    """A tiny model whose padding is most of the vocabulary and whose padded rows have the largest logits:
    without the restriction vLLM would sample them nearly always."""
    from flashdapo.config import RolloutConfig
    from flashdapo.models.weights import iter_full_state_dict
    from flashdapo.rollout.vllm_engine import VLLMEngine
    from tests.vllm.toy import KV_GIB

    config = family_config("qwen2", hidden=64, layers=1, vocab=vocab, tied=False, head_dim=32)
    path = model_dir(root / "padded-head", config, tokens)
    model = hf_model(config)
    with torch.no_grad():
        model.lm_head.weight[tokens:] *= 50.0
    engine = VLLMEngine(RolloutConfig(engine="vllm", kv_cache_gib=KV_GIB), str(path), rank=0, world_size=1,
                        dtype="float32", max_model_len=64, seed=0)
    engine.update_weights(iter_full_state_dict(model))
    rollouts = engine.generate([[5, 6, 7], [8, 9]], _sampling())
    sampled = [int(t) for r in rollouts.response_ids for t in r]
    with torch.no_grad():  # what the unrestricted policy puts on the padding at the first step
        probs = torch.softmax(model(torch.tensor([[5, 6, 7]])).logits[0, -1] / 2.0, -1)
    engine.shutdown()
    return {"started": engine.started_line, "sampled_max": max(sampled), "sampled_count": len(sampled),
            "padding_mass": probs[tokens:].sum().item()}


def _init_process_group() -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)


def one(out_path: str, case: str, root: str, hidden: int, layers: int, vocab: int, tokens: int) -> None:
    """One engine in this process (vLLM's engine shutdown destroys the process group: one engine a process)."""
    _init_process_group()
    if case == "padded-head":
        result = padded_head_model(Path(root))
    else:
        family, tied = case.split("-")
        result = run_family(Path(root), family, tied == "tied", hidden, layers, vocab, tokens)
    Path(out_path).write_text(json.dumps(result))


def main(out_path: str, hidden: int = HIDDEN, layers: int = LAYERS, vocab: int = VOCAB, tokens: int = TOKENS,
         families: tuple[str, ...] = FAMILIES, with_padded_head: bool = True) -> dict:
    """Every case, each in a process of its own; what they returned, also written to `out_path`."""
    import subprocess
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="padded_vocab_"))
    cases = ["padded-head"] + [f"{f}-{t}" for f in families for t in (("untied", "tied") if f == "qwen2" else
                                                                      ("untied",))]
    if not with_padded_head:
        cases.remove("padded-head")
    results: dict = {"families": []}
    for case in cases:
        part = root / f"{case}.json"
        subprocess.run([sys.executable, "-m", "tests.vllm.padded_vocab", "--one", str(part), case, str(root),
                        str(hidden), str(layers), str(vocab), str(tokens)], check=True, timeout=1800)
        result = json.loads(part.read_text())
        if case == "padded-head":
            results["padded_head"] = result
        else:
            results["families"].append(result)
        Path(out_path).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        one(sys.argv[2], sys.argv[3], sys.argv[4], *(int(a) for a in sys.argv[5:9]))
    else:
        numbers = [int(a) for a in sys.argv[2:6]]
        main(sys.argv[1], *numbers, *([tuple(sys.argv[6].split(","))] if len(sys.argv) > 6 else []),
             with_padded_head=len(sys.argv) <= 7)

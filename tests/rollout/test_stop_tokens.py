"""The stop set both rollout engines share (tokenizer.eos_token_ids, built by rollout.factory.build_engine) on
a Llama-3-style model directory: the tokenizer's eos `<|end_of_text|>`, the chat template's `<|eot_id|>`, and
generation_config.json listing both. Before, only the tokenizer's eos stopped a response: a chat model that ends
its turn in `<|eot_id|>` ran every response to the length limit."""

from __future__ import annotations

import json

import pytest

from flashdapo.config import RolloutConfig, ToyTaskConfig
from flashdapo.rollout.base import Request, SamplingParams
from flashdapo.rollout.factory import build_engine, cpu_env
from flashdapo.tasks.toy import build_toy_tokenizer
from flashdapo.tokenizer import (
    chat_end_of_turn_ids,
    describe_stop_ids,
    eos_token_ids,
    generation_config_eos_ids,
    load_tokenizer,
)
from tests.helpers.llama3_dir import END_OF_TEXT, EOT, llama3_model_dir, scripted_llama
from tests.helpers.vllm_double import FAKE_VLLM, STREAM_VLLM, make_engine, push

pytestmark = pytest.mark.usefixtures("torchrun_env")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return llama3_model_dir(tmp_path_factory.mktemp("llama3"))


def ids_of(tok, *tokens):
    return [tok.convert_tokens_to_ids(t) for t in tokens]


def test_stop_set_has_the_eos_and_the_end_of_turn(llama3):
    tok = load_tokenizer(str(llama3))
    end_of_text, eot = ids_of(tok, END_OF_TEXT, EOT)
    assert tok.eos_token_id == end_of_text  # what alone stopped a response before
    assert eos_token_ids(tok) == [end_of_text, eot]
    assert eos_token_ids(tok, llama3) == [end_of_text, eot]
    assert generation_config_eos_ids(llama3) == [end_of_text, eot]
    assert chat_end_of_turn_ids(tok) == [eot]
    assert describe_stop_ids(tok, [end_of_text, eot]) == "1 '<|end_of_text|>', 4 '<|eot_id|>'"


def test_each_source_alone_adds_the_end_of_turn(llama3, tmp_path):
    tok = load_tokenizer(str(llama3))
    end_of_text, eot = ids_of(tok, END_OF_TEXT, EOT)
    tok.chat_template = None  # generation_config.json alone
    assert eos_token_ids(tok, llama3) == [end_of_text, eot]
    tok = load_tokenizer(str(llama3))  # the chat template alone (no generation_config.json there)
    assert eos_token_ids(tok, tmp_path) == [end_of_text, eot]


def test_generation_config_int_and_non_special_ids(llama3, tmp_path):
    tok = load_tokenizer(str(llama3))
    tok.chat_template = None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert eos_token_ids(tok, tmp_path) == [1, 4]
    word = tok.convert_tokens_to_ids("a")  # a config default pointing at an ordinary token: not a stop
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [word, 4]}))
    assert eos_token_ids(tok, tmp_path) == [1, 4]
    (tmp_path / "generation_config.json").write_text("not json")
    assert eos_token_ids(tok, tmp_path) == [1]


def test_chatml_tokenizer_keeps_its_stop_set():
    tok = build_toy_tokenizer(ToyTaskConfig())
    vocab = tok.get_vocab()
    assert eos_token_ids(tok) == [tok.eos_token_id, vocab["<|endoftext|>"]]
    assert chat_end_of_turn_ids(tok) == [vocab["<|im_end|>"]]


def test_torch_engine_stops_at_eot(llama3, capsys):
    tok = load_tokenizer(str(llama3))
    model = scripted_llama(llama3)
    engine = build_engine(RolloutConfig(engine="torch", max_num_seqs=4), cpu_env(), tok, model=model,
                          model_path=str(llama3))
    assert "torch rollouts stop at 1 '<|end_of_text|>', 4 '<|eot_id|>'" in capsys.readouterr().out
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    out = engine.generate([list(prompt)], SamplingParams(n=2, max_new_tokens=12, seed=3))
    a, b, c, eot = ids_of(tok, "a", "b", "c", EOT)
    assert [r.tolist() for r in out.response_ids] == [[a, b, c, eot]] * 2
    assert out.truncated.tolist() == [False, False]


def test_torch_engine_with_the_tokenizer_eos_only_runs_to_the_limit(llama3):
    """The failure the stop set fixes: stopping on `<|end_of_text|>` alone, the same model never stops."""
    from flashdapo.rollout.torch_engine import TorchEngine

    tok = load_tokenizer(str(llama3))
    engine = TorchEngine(scripted_llama(llama3), [tok.eos_token_id], tok.pad_token_id, "cpu")
    out = engine.generate([[0, 2]], SamplingParams(n=1, max_new_tokens=9, seed=3))
    assert out.truncated.tolist() == [True] and len(out.response_ids[0]) == 9


def test_vllm_sampling_params_carry_the_stop_ids(llama3, capsys):
    tok = load_tokenizer(str(llama3))
    engine = build_engine(RolloutConfig(engine="vllm"), cpu_env(), tok, model_path=str(llama3),
                          vllm_module=FAKE_VLLM, max_model_len=64)
    assert "vllm rollouts stop at 1 '<|end_of_text|>', 4 '<|eot_id|>'" in capsys.readouterr().out
    assert engine.stop_token_ids == (1, 4)
    push(engine)
    engine.generate([[0, 2], [0, 3]], SamplingParams(n=2, max_new_tokens=4, seed=1))
    (params,) = [call[2] for call in engine.llm.calls if call[0] == "generate"]
    assert [p.stop_token_ids for p in params] == [[1, 4], [1, 4]]


def test_vllm_stream_requests_carry_the_stop_ids(llama3):
    tok = load_tokenizer(str(llama3))
    engine = build_engine(RolloutConfig(engine="vllm"), cpu_env(), tok, model_path=str(llama3),
                          vllm_module=STREAM_VLLM, max_model_len=64)
    push(engine)
    engine.open_stream(SamplingParams(max_new_tokens=4, seed=1))
    engine.submit([Request(key=0, prompt=(0, 2), max_new_tokens=4, seed=7)])
    engine.step()
    added = [call[3] for call in engine.llm.llm_engine.calls if call[0] == "add"]
    assert [p.stop_token_ids for p in added] == [[1, 4]]
    engine.abort()


def test_engine_built_directly_adds_no_stop_ids():
    """VLLMEngine without stop ids (tests, callers outside build_engine) leaves SamplingParams as before."""
    engine = make_engine()
    push(engine)
    engine.generate([[5, 6]], SamplingParams(max_new_tokens=2, seed=1))
    (params,) = [call[2] for call in engine.llm.calls if call[0] == "generate"]
    assert params[0].stop_token_ids is None

"""The locally trained toy tokenizer and loading a tokenizer directory."""

from __future__ import annotations

import time

import pytest

from flashdapo.config import ToyTaskConfig
from flashdapo.tokenizer import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    build_toy_tokenizer,
    eos_token_ids,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer(ToyTaskConfig())


def test_deterministic_small_and_fast():
    start = time.perf_counter()
    a = build_toy_tokenizer(ToyTaskConfig())
    assert time.perf_counter() - start < 1.0
    b = build_toy_tokenizer(ToyTaskConfig())
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) <= 512


def test_special_tokens(tok):
    assert tok.pad_token == PAD_TOKEN and tok.eos_token == IM_END
    for token in (PAD_TOKEN, IM_START, IM_END):
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == [token]
    assert tok.encode("1+2", add_special_tokens=True) == tok.encode("1+2", add_special_tokens=False)  # no BOS


@pytest.mark.parametrize("text", [
    "Answer: 19",
    "Compute 7+12. End with Answer: N",
    "  leading and trailing spaces  \n\n\ttabs",
    "Unicode: é, ö, 日本語, emoji 🙂, math $\\frac{1}{2}$",
    "1234567890 -3 4.5e-7 x^2",
])
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_digits_are_single_tokens(tok):
    ids = tok.encode("Answer: 2024", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[-4:] == ["2", "0", "2", "4"]


def test_response_decodes_without_eos(tok):
    ids = tok.encode("Answer: 19", add_special_tokens=False) + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "Answer: 19"
    assert len(ids) <= 12  # fits the toy preset's max_response_length


def test_chat_template(tok):
    messages = [{"role": "user", "content": "Compute 7+12."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nCompute 7+12.<|im_end|>\n<|im_start|>assistant\n"
    no_gen = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_gen == "<|im_start|>user\nCompute 7+12.<|im_end|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids(IM_START)
    assert tok.decode(ids) == text


def test_eos_token_ids(tok):
    ids = eos_token_ids(tok)
    assert ids[0] == tok.eos_token_id
    assert set(ids) == {tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(PAD_TOKEN)}


def test_save_and_load(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    messages = [{"role": "user", "content": "Compute 3*4."}]
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert loaded.encode("Answer: 12") == tok.encode("Answer: 12")
    assert loaded.pad_token == PAD_TOKEN and eos_token_ids(loaded) == eos_token_ids(tok)


def test_load_sets_missing_pad(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    import json

    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("pad_token", None)
    config_path.write_text(json.dumps(config))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == PAD_TOKEN


def test_load_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="cannot load"):
        load_tokenizer(str(tmp_path))  # exists, but holds no tokenizer

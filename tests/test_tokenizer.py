"""Loading a tokenizer directory (saved from the toy tokenizer) and the tokens that end a response."""

from __future__ import annotations

import pytest

from flashdapo.config import ToyTaskConfig
from flashdapo.tasks.toy import build_toy_tokenizer
from flashdapo.tokenizer import IM_END, PAD_TOKEN, eos_token_ids, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer(ToyTaskConfig())


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

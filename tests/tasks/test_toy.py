"""The toy task: problems and records, warm-up examples, its tokenizer and model."""

from __future__ import annotations

import random
import statistics
import time

import pytest
import torch

from flashdapo.config import ConfigError, ModelConfig, ToyTaskConfig
from flashdapo.config import preset as named_preset
from flashdapo.data import chat_ids
from flashdapo.tasks.toy import (
    FILLER,
    FILLER_CAP,
    TOY_DATA_SOURCE,
    build_toy_model,
    build_toy_tokenizer,
    toy_problems,
    toy_records,
    toy_sft_examples,
)
from flashdapo.tokenizer import IM_END, IM_START, PAD_TOKEN


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer(ToyTaskConfig())


def test_toy_deterministic_disjoint_and_correct():
    cfg = ToyTaskConfig(num_train=300, num_val=40, max_operand=9, ops="+-*", seed=7, held_out_val=True)
    train, val = toy_records(cfg, "train"), toy_records(cfg, "val")
    assert [r.messages for r in train] == [r.messages for r in toy_records(cfg, "train")]
    assert len(train) == 300 and len(val) == 40
    train_prompts = {r.messages[0]["content"] for r in train}
    val_prompts = {r.messages[0]["content"] for r in val}
    assert len(val_prompts) == 40 and not train_prompts & val_prompts
    for r in train + val:
        expr = r.messages[0]["content"].removeprefix("Compute ").split(".")[0]
        assert r.ground_truth == str(eval(expr)) and int(r.ground_truth) >= 0
        assert r.data_source == TOY_DATA_SOURCE and r.messages[0]["role"] == "user"
    assert {op for op in "+-*" if any(op in c for c in train_prompts)} == set("+-*")
    other = toy_records(ToyTaskConfig(num_train=300, num_val=40, max_operand=9, ops="+-*", seed=8,
                                      held_out_val=True), "train")
    assert [r.messages for r in other] != [r.messages for r in train]


def test_toy_config_knobs():
    cfg = ToyTaskConfig(num_train=10, num_val=2, max_operand=3, prompt_format="{a} {op} {b} =")
    record = toy_records(cfg, "train")[0]
    assert record.messages[0]["content"].endswith("=") and "{" not in record.messages[0]["content"]
    with pytest.raises(ConfigError, match="data.toy.num_val"):
        toy_problems(ToyTaskConfig(max_operand=3, num_val=16, held_out_val=True))  # 16 problems, none left
    with pytest.raises(ConfigError, match="data.toy.num_val"):
        toy_problems(ToyTaskConfig(max_operand=3, num_val=17))  # only 16 distinct problems
    _, every = toy_problems(ToyTaskConfig(max_operand=3, num_val=16))  # validation on the whole task
    assert len(set(every)) == 16
    with pytest.raises(ConfigError, match="data.toy.ops"):
        ToyTaskConfig(ops="+/")
    with pytest.raises(ConfigError, match="data.toy.prompt_format"):
        ToyTaskConfig(prompt_format="Compute {x}.")
    with pytest.raises(ConfigError, match="data.toy.prompt_format"):
        ToyTaskConfig(prompt_format="no fields")


def test_toy_sft_examples():
    cfg = ToyTaskConfig(num_train=100, num_val=20, held_out_val=True, wrong_fraction=0.0, verbose_fraction=0.0)
    examples = toy_sft_examples(cfg, 50, random.Random(0))
    assert examples == toy_sft_examples(cfg, 50, random.Random(0))
    val_prompts = {r.messages[0]["content"] for r in toy_records(cfg, "val")}
    for record, response in examples:
        assert response == f"Answer: {record.ground_truth}"
        assert record.messages[0]["content"] not in val_prompts


def test_toy_sft_examples_wrong_and_verbose_fractions():
    cfg = ToyTaskConfig(num_train=100, wrong_fraction=0.5, verbose_fraction=0.5)
    examples = toy_sft_examples(cfg, 2000, random.Random(1))
    wrong = verbose = 0
    for record, response in examples:
        value = int(response.rsplit("Answer: ", 1)[1])
        truth = int(record.ground_truth)
        assert value >= 0 and (value == truth or 1 <= abs(value - truth) <= 3)
        wrong += value != truth
        if "\n" in response:
            verbose += 1
            expr = record.messages[0]["content"].removeprefix("Compute ").split(".")[0]
            assert response.startswith(f"{expr}={value}\nAnswer: ")
    assert 0.45 < wrong / 2000 < 0.55 and 0.45 < verbose / 2000 < 0.55


def test_longtail_demonstrations_open_with_heavy_tailed_filler(tok):
    """The `longtail` preset's warm-up answers: a line of lognormal filler (median ~8, capped at 20x the median)
    before a plain toy answer, every one under the response limit; the default toy has none."""
    cfg = named_preset("longtail")
    toy, limit = cfg.data.toy, cfg.rollout.max_response_length
    examples = toy_sft_examples(toy, 300, random.Random(0))
    counts, lengths = [], []
    for _, response in examples:
        first = response.split("\n", 1)[0]
        count = len(first) if set(first) == {FILLER} else 0
        answer = response[count + 1:] if count else response
        assert answer.rsplit("Answer: ", 1)[1].isdigit()
        counts.append(count)
        lengths.append(len(tok.encode(response, add_special_tokens=False)) + 1)  # + EOS
        # One token per filler character, one for the newline: the answer's tokens are those of the plain toy.
        assert lengths[-1] == len(tok.encode(answer, add_special_tokens=False)) + 1 + count + (count > 0)
    assert 6 <= statistics.median(counts) <= 10 and max(counts) <= FILLER_CAP * toy.filler_median
    assert max(lengths) >= 5 * statistics.median(lengths) and max(lengths) <= limit
    plain = toy_sft_examples(ToyTaskConfig(), 300, random.Random(0))
    assert not any(r.startswith(FILLER) for _, r in plain)


def test_toy_prompt_is_short(tok):
    record = toy_records(ToyTaskConfig(), "train")[0]
    assert len(chat_ids(tok, record.messages)) <= 32


# --------------------------------------------------------------------------------------------------- tokenizer


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


# --------------------------------------------------------------------------------------------------- model


def test_toy_model_is_deterministic_in_its_seed():
    a, b, c = (build_toy_model(ModelConfig(), vocab_size=40, max_positions=32, seed=s) for s in (1, 1, 2))
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(a(ids).logits, b(ids).logits) and not torch.equal(a(ids).logits, c(ids).logits)
    assert a.config.hidden_size == ModelConfig().toy.hidden_size and a.config.tie_word_embeddings

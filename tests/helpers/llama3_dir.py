"""A tiny Llama-3-style model directory, as Meta's uploads and many fine-tunes ship: the tokenizer's eos is
`<|end_of_text|>`, the chat template ends every turn in `<|eot_id|>`, and generation_config.json lists both
as eos_token_id. A word-level tokenizer over a handful of words; a random 1-layer LlamaForCausalLM."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BEGIN, END_OF_TEXT, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
SPECIALS = [BEGIN, END_OF_TEXT, HEADER_START, HEADER_END, EOT]
WORDS = ["user", "assistant", "system", "hi", "a", "b", "c", "d", "what", "is", "two", "plus", "[UNK]"]
# Llama-3's template, shortened (no system-prompt default, no tools).
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def llama3_tokenizer() -> PreTrainedTokenizerFast:
    """Specials first (ids 0..4: `<|end_of_text|>` 1, `<|eot_id|>` 4), then the words, split on whitespace."""
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BEGIN, eos_token=END_OF_TEXT, unk_token="[UNK]",
                                 clean_up_tokenization_spaces=False)
    hf.add_special_tokens({"additional_special_tokens": [HEADER_START, HEADER_END, EOT]})
    hf.chat_template = LLAMA3_TEMPLATE
    return hf


def llama3_model_dir(path: Path, generation_eos: list[str] | None = None) -> Path:
    """The directory: tokenizer files, a random tiny Llama (seed 0) and generation_config.json whose
    eos_token_id lists `generation_eos` (default both `<|end_of_text|>` and `<|eot_id|>`)."""
    tok = llama3_tokenizer()
    ids = [tok.convert_tokens_to_ids(t) for t in (generation_eos or [END_OF_TEXT, EOT])]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=tok.bos_token_id, eos_token_id=ids, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": ids if len(ids) > 1 else ids[0], "do_sample": True}))
    return path


class ScriptedLlama(LlamaForCausalLM):
    """A Llama whose next token is scripted by the last input token: `a` -> `b` -> `c` -> `<|eot_id|>`, anything
    else -> `a` (a +100 logit bias over the random model's logits). A model that has learnt to end its turn."""

    script: dict[int, int] = {}
    fallback: int = 0

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        last = input_ids[:, -1].tolist()
        bias = torch.zeros_like(out.logits[:, -1])
        for row, token in enumerate(last):
            bias[row, self.script.get(int(token), self.fallback)] = 100.0
        out.logits = out.logits.clone()
        out.logits[:, -1] += bias
        return out


def scripted_llama(path: Path) -> ScriptedLlama:
    """The model of `llama3_model_dir(path)`, scripted to answer `a b c <|eot_id|>`."""
    tok = llama3_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", EOT)}
    model = ScriptedLlama.from_pretrained(path, dtype=torch.float32)
    model.script = {ids["a"]: ids["b"], ids["b"]: ids["c"], ids["c"]: ids[EOT]}
    model.fallback = ids["a"]
    return model.eval()

"""The final export keeps what the source model directory gave (flashdapo/trainer/state/export.py): its
generation_config.json and tokenizer files byte for byte, the plain chat template training added written beside
them rather than into them, and weights that reload as the trainer ended with them. Wall budget: 30 s."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from flashdapo.preflight import PLAIN_CHAT_TEMPLATE
from flashdapo.trainer import loop
from flashdapo.trainer.loop import train
from flashdapo.trainer.state.export import ADDED_CHAT_TEMPLATE, EXPORT_MANIFEST, export_hf
from tests.helpers.data_files import train_file
from tests.helpers.model_dirs import model_dir
from tests.helpers.runs import tiny_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _source(path):
    """A tiny Qwen2 directory whose tokenizer has no chat template, with a generation_config.json of its own (a
    custom eos list, sampling defaults) and tokenizer_config.json laid out as no transformers version writes it:
    a re-serialised file would differ."""
    source = model_dir(path, chat_template=False)
    tok = AutoTokenizer.from_pretrained(source)
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    (source / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "temperature": 0.6, "top_p": 0.95, "do_sample": True, "note": "the source's"},
        indent=3) + "\n")
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps(config, indent=7, sort_keys=True))
    return source, eos


def test_a_runs_export_keeps_the_sources_generation_config_and_tokenizer(tmp_path, monkeypatch):
    source, eos = _source(tmp_path / "source")
    handed: dict[str, torch.Tensor] = {}

    def recording_export(named_tensors, *args, **kwargs):  # what the loop hands the export: its final weights
        handed.update((name, tensor.detach().clone()) for name, tensor in named_tensors)
        return export_hf(iter(handed.items()), *args, **kwargs)

    monkeypatch.setattr(loop, "export_hf", recording_export)
    run_dir = tmp_path / "run"
    # The random verifier: an untrained model's responses (all truncated alike) still get different rewards, so
    # the update moves the weights and the export's are not the source's.
    cfg = tiny_config(run_dir, model={"path": str(source)}, data={"train_files": [str(train_file(tmp_path / "d.jsonl"))],
                                                                  "max_prompt_length": 32},
                      rollout={"max_response_length": 4}, algorithm={"overlong_buffer_len": 2, "verifier": "random"},
                      trainer={"val_every": 0, "val_before_train": False}, logging={"plot": False})
    run = train(cfg)
    export = run_dir / "export"
    assert run.tokenizer.chat_template == PLAIN_CHAT_TEMPLATE  # training used the plain template...
    for name in ("generation_config.json", *TOKENIZER_FILES):  # ...the export keeps the source's files
        assert (export / name).read_bytes() == (source / name).read_bytes(), name
    assert not (export / "chat_template.jinja").exists()
    assert (export / ADDED_CHAT_TEMPLATE).read_text() == PLAIN_CHAT_TEMPLATE
    manifest = json.loads((export / EXPORT_MANIFEST).read_text())
    assert ADDED_CHAT_TEMPLATE in manifest["files"] and ADDED_CHAT_TEMPLATE in manifest["added"]
    reloaded_tokenizer = AutoTokenizer.from_pretrained(export)
    assert reloaded_tokenizer.chat_template is None
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == eos

    loaded = AutoModelForCausalLM.from_pretrained(export)
    assert loaded.generation_config.temperature == 0.6 and loaded.generation_config.eos_token_id == eos
    weights = loaded.state_dict()
    assert handed and set(handed) <= set(weights)
    for name, tensor in handed.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
    initial = load_file(source / "model.safetensors")
    assert any(not torch.equal(initial[name], handed[name]) for name in initial if name in handed)  # it trained


def test_the_toy_models_export_writes_its_stop_set_as_generation_config(tmp_path):
    """The built-in toy model has no source directory: generation_config.json says the ids training stopped
    responses on (tokenizer.eos_token_ids) and its pad id, and the in-memory tokenizer is saved with its own
    ChatML template (no separate template file)."""
    from flashdapo.config import ModelConfig, ToyModelConfig, ToyTaskConfig
    from flashdapo.tasks.toy import build_toy_model, build_toy_tokenizer
    from flashdapo.tokenizer import eos_token_ids

    tokenizer = build_toy_tokenizer(ToyTaskConfig())
    model = build_toy_model(ModelConfig(toy=ToyModelConfig(hidden_size=16, intermediate_size=32)), len(tokenizer),
                            32, seed=0)
    out = tmp_path / "export"
    export_hf(model.state_dict().items(), model.config, tokenizer, out, True)
    written = json.loads((out / "generation_config.json").read_text())
    stops = eos_token_ids(tokenizer)
    assert len(stops) > 1 and written["eos_token_id"] == stops and written["pad_token_id"] == tokenizer.pad_token_id
    assert not {"temperature", "top_p", "top_k"} & set(written)
    assert not (out / ADDED_CHAT_TEMPLATE).exists()
    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template

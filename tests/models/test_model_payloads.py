"""Files in a model directory that would run code if loaded unsafely: a pytorch_model.bin holding a pickled
object (refused in one line naming it, before the model loads, without torch's hint to pass
weights_only=False) and a chat template transformers' sandbox refuses (jinja2's SecurityError: one line
naming the template's file). Sound .bin weights, and a training_args.bin beside safetensors weights, load."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from flashdapo.__main__ import main as cli
from flashdapo.config import ToyTaskConfig
from flashdapo.data import DataError, chat_ids
from flashdapo.models.model_dir import ModelDirError, check_model_dir
from flashdapo.preflight import check_model
from flashdapo.tasks.toy import build_toy_tokenizer
from tests.helpers.model_dirs import model_dir

SANDBOXED = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""A chat template reaching for Python's classes, as a malicious one does: transformers' sandbox refuses it."""


class Payload:
    def __reduce__(self):
        return (os.system, ("echo unpickled > /dev/null",))


def bin_model(path, payload: bool):
    """A tiny model directory whose weights are a pytorch_model.bin (with a pickled object when `payload`)."""
    model_dir(path)
    weights = {}
    for shard in path.glob("*.safetensors"):
        weights.update(load_file(shard))
        shard.unlink()
    if payload:
        weights["extra"] = Payload()
    torch.save(weights, path / "pytorch_model.bin")
    return path


def test_a_pickled_object_in_pytorch_model_bin_is_refused_in_one_line(tmp_path):
    path = bin_model(tmp_path / "m", payload=True)
    with pytest.raises(ModelDirError) as info:
        check_model_dir(path)
    message = str(info.value)
    assert message.startswith(f"{path / 'pytorch_model.bin'}: not model weights: it holds a pickled Python object")
    assert "weights_only" not in message and "will likely succeed" not in message and "\n" not in message


def test_eval_refuses_a_pickled_bin_before_the_model_loads(tmp_path, capsys):
    path = bin_model(tmp_path / "m", payload=True)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    capsys.readouterr()  # the model directory's own save output
    assert cli(["eval", "--model", str(path), "--data", str(data), "--out", str(tmp_path / "out"), "--k", "1",
                "--max-new-tokens", "2", "--max-prompt-length", "32", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"flashdapo: error: {path / 'pytorch_model.bin'}: not model weights") and err.count("\n") == 1


def test_sound_bin_weights_and_a_training_args_bin_beside_safetensors_pass(tmp_path):
    check_model_dir(bin_model(tmp_path / "bin", payload=False))
    beside = model_dir(tmp_path / "st")
    torch.save({"args": Payload()}, beside / "training_args.bin")  # HF Trainer's pickle: never loaded as weights
    check_model_dir(beside)


def _template(text: str):
    def edit(path):
        (path / "chat_template.jinja").write_text(text)
    return edit


def test_a_chat_template_the_sandbox_refuses_is_one_line_naming_its_file(tmp_path):
    path = model_dir(tmp_path / "m", tokenizer_edit=_template(SANDBOXED))
    with pytest.raises(ModelDirError) as info:
        check_model(str(path), "model.path", 32, "data.max_prompt_length + rollout.max_response_length")
    message = str(info.value)
    assert message.startswith(f"{path}/chat_template.jinja: the chat template fails on a plain user message "
                              "(SecurityError: access to attribute '__class__' of 'str' object is unsafe.)")
    assert "sandbox refused it" in message and "\n" not in message


def test_train_refuses_a_sandboxed_template_in_one_line(tmp_path, capsys):
    path = model_dir(tmp_path / "m", tokenizer_edit=_template(SANDBOXED))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    capsys.readouterr()  # the model directory's own save output
    assert cli(["train", "--model.path", str(path), "--data.train-files", str(data), "--logging.run-dir",
                str(tmp_path / "run"), "--data.max-prompt-length", "16", "--rollout.max-response-length", "16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"flashdapo: error: {path}/chat_template.jinja: the chat template fails") and \
        err.count("\n") == 1, err


def test_a_template_failing_on_one_prompt_names_the_prompt():
    tokenizer = build_toy_tokenizer(ToyTaskConfig())
    tokenizer.chat_template = ("{% if 'boom' in messages[0]['content'] %}{{ raise_exception('no boom') }}{% endif %}"
                               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat_ids(tokenizer, [{"role": "user", "content": "1+1"}])
    with pytest.raises(DataError, match=r"^data\.jsonl:3: the chat template of .* fails on it \(TemplateError: no "
                                        r"boom\); use the model's original tokenizer files"):
        chat_ids(tokenizer, [{"role": "user", "content": "boom"}], "data.jsonl:3")

"""A LoRA run's exports (trainer/state/adapter_export.py): a PEFT adapter directory that peft loads onto the
base it names, equal, merged, to the trained policy; the merged export; a model.path run names model.path and
records the base's fingerprint, so a resume onto another base is refused in one line."""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from flashdapo.trainer.loop import train
from flashdapo.trainer.state.resume import ResumeRefused
from tests.helpers.data_files import train_file
from tests.helpers.model_dirs import model_dir
from tests.helpers.runs import quick_config, resume_config, tiny_config


def test_the_adapter_export_loads_in_peft_and_equals_the_trained_policy_merged(tmp_path, capsys):
    run_dir = tmp_path / "run"
    # the random verifier: the untrained toy's responses still get different rewards, so the adapters move
    run = train(tiny_config(run_dir, lora={"rank": 4}, algorithm={"verifier": "random"},
                            checkpoint={"export_merged": True}, trainer={"val_every": 0}))
    out = capsys.readouterr().out
    # 2 blocks x 7 adapted linears x (A, B), and the 5 norms trained whole (lora.train_norms "all")
    assert "trainable of" in out and "exported the adapters (33 tensors" in out
    config = json.loads((run_dir / "export" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 32.0 and config["peft_type"] == "LORA"
    assert sorted(config["modules_to_save"]) == sorted(
        ["model.norm"] + [f"model.layers.{i}.{n}" for i in (0, 1) for n in ("input_layernorm",
                                                                              "post_attention_layernorm")])
    assert config["base_model_name_or_path"] == str((run_dir / "export-base").resolve())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    ids = torch.randint(0, base.config.vocab_size, (3, 9))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, run_dir / "export").eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "export-merged", dtype=torch.float32)(
            input_ids=ids).logits
        trained = run.policy(input_ids=ids).logits  # the FSDP2 root gathers its shards
    torch.testing.assert_close(adapted, trained, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, trained, rtol=0, atol=1e-5)
    assert (base_logits - trained).abs().max() > 1e-3  # the adapters trained


@pytest.mark.slow
def test_a_model_path_runs_adapter_names_it_and_a_resume_onto_another_base_is_refused(tmp_path):
    torch.manual_seed(0)
    source = model_dir(tmp_path / "base")
    data = {"train_files": [str(train_file(tmp_path / "d.jsonl"))], "max_prompt_length": 32}
    common = dict(model={"path": str(source)}, data=data, lora={"rank": 2}, rollout={"max_response_length": 4},
                  algorithm={"overlong_buffer_len": 2, "verifier": "random"})
    train(quick_config(tmp_path / "run", **common))
    config = json.loads((tmp_path / "run" / "export" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(source) and not (tmp_path / "run" / "export-base").exists()
    torch.manual_seed(1)
    other = model_dir(tmp_path / "other")  # same shapes, other weights
    with pytest.raises(ResumeRefused) as err:
        train(resume_config(tmp_path / "run", **{**common, "model": {"path": str(other)}},
                            trainer={"total_steps": 3}))
    assert "lora.base sha256:" in str(err.value) and "\n" not in str(err.value)

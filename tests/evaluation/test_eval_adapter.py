"""A LoRA adapter directory as eval's and generate's --model (eval/adapter.py): the torch engine samples the merged
model's tokens (replica and --fsdp), not the base's; vLLM (its recording double) starts on the base with LoRA
enabled and names the adapter in every generate; a base that is no directory, --base with a plain model, and
adapters vLLM cannot serve are refused in one line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from flashdapo.__main__ import main as cli
from flashdapo.config import ConfigError, ToyTaskConfig
from flashdapo.eval import adapter as adapter_module
from flashdapo.eval.adapter import model_source
from flashdapo.sync.vllm import VLLM_LORA_RANKS, max_lora_rank
from flashdapo.tasks.toy import toy_records
from tests.evaluation.toy_export import toy_export
from tests.helpers.adapter_dirs import lora_adapter

SAMPLING = ["--max-new-tokens", "6", "--seed", "5", "--max-prompt-length", "256"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter")
    base = toy_export(root / "base")
    adapter, merged = lora_adapter(base, root, rank=4, alpha=64.0, norms=True)  # norms as a LoRA run exports them
    records = toy_records(ToyTaskConfig(num_val=3), "val")
    data = root / "toy.jsonl"
    data.write_text("".join(json.dumps({"prompt": r.messages, "reward_model": {"ground_truth": r.ground_truth}})
                            + "\n" for r in records))
    return SimpleNamespace(base=base, adapter=adapter, merged=merged, data=data)


def responses(path: Path) -> list[list[str]]:
    return [[s["response"] for s in json.loads(line)["samples"]] for line in path.read_text().splitlines()]


def generated(model: Path, out: Path, *extra: str) -> list[list[str]]:
    assert cli(["generate", "--model", str(model), "--examples", "--n", "3", *SAMPLING, "--out", str(out),
                *extra]) == 0
    return responses(out)


def evaluated(model: Path, data: Path, out: Path, *extra: str) -> list[list[str]]:
    assert cli(["eval", "--model", str(model), "--data", str(data), "--out", str(out), "--k", "3", "--no-progress",
                *SAMPLING, *extra]) == 0
    return responses(out / "samples.jsonl")


def test_generate_samples_the_merged_model_not_the_base(dirs, tmp_path, capsys):
    adapted = generated(dirs.adapter, tmp_path / "adapter.jsonl")
    assert (f"flashdapo: LoRA adapter {dirs.adapter} (rank 4) over the base {dirs.base}, merged into the base "
            "with peft") in capsys.readouterr().out
    assert adapted == generated(dirs.merged, tmp_path / "merged.jsonl")
    assert adapted != generated(dirs.base, tmp_path / "base.jsonl")


def test_eval_samples_the_merged_model_as_a_replica_and_under_fsdp(dirs, tmp_path):
    adapted = evaluated(dirs.adapter, dirs.data, tmp_path / "adapter")
    assert adapted == evaluated(dirs.merged, dirs.data, tmp_path / "merged")
    assert adapted != evaluated(dirs.base, dirs.data, tmp_path / "base")
    # One rank of FSDP2 (rank 0 merges before the broadcast) draws the replica's tokens.
    assert evaluated(dirs.adapter, dirs.data, tmp_path / "fsdp", "--fsdp") == adapted
    settings = json.loads((tmp_path / "adapter" / "eval_settings.json").read_text())
    assert settings["model"] == str(dirs.adapter.resolve()) and settings["base"] == str(dirs.base.resolve())


def moved(dirs, tmp_path: Path, base: str = "/nowhere/base") -> Path:
    """A copy of the adapter whose adapter_config.json names `base`."""
    adapter = shutil.copytree(dirs.adapter, tmp_path / "moved")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
    return adapter


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_base_that_is_no_directory_is_refused_in_one_line_and_base_overrides_it(dirs, tmp_path, capsys,
                                                                                  command):
    adapter = moved(dirs, tmp_path)
    args = (["eval", "--data", str(dirs.data), "--out", str(tmp_path / "out"), "--no-progress"]
            if command == "eval" else ["generate", "--examples"])
    assert cli([*args, "--model", str(adapter)]) == 1
    assert capsys.readouterr().err == (
        f"flashdapo: error: {adapter}/adapter_config.json: base_model_name_or_path '/nowhere/base' is not a "
        "directory; it must name the base model the adapter was trained on (an HF checkpoint directory): give it "
        "with --base DIR\n")
    if command == "generate":  # --base DIR: the adapter's samples, as with the base it names
        assert generated(adapter, tmp_path / "a.jsonl", "--base", str(dirs.base)) == \
            generated(dirs.adapter, tmp_path / "b.jsonl")


def test_base_with_a_plain_model_and_an_adapter_without_weights_are_refused(dirs, tmp_path, capsys):
    assert cli(["generate", "--model", str(dirs.merged), "--base", str(dirs.base), "--examples"]) == 2
    assert capsys.readouterr().err == (
        f"flashdapo: config error: generate.base: expected '' (--base is the base of an adapter directory; --model "
        f"{dirs.merged} holds no adapter_config.json), got '{dirs.base}'\n")
    adapter = moved(dirs, tmp_path, str(dirs.base))
    (adapter / "adapter_model.safetensors").unlink()
    assert cli(["generate", "--model", str(adapter), "--examples"]) == 1
    assert capsys.readouterr().err == (
        f"flashdapo: error: --model={adapter}: an adapter directory (adapter_config.json) without its weights "
        "(adapter_model.safetensors or adapter_model.bin); copy the whole export\n")


def test_vllm_refuses_a_rank_past_its_largest_and_dora(dirs, tmp_path, monkeypatch):
    assert [max_lora_rank(r, VLLM_LORA_RANKS) for r in (1, 4, 8, 9, 512, 513)] == [1, 8, 8, 16, 512, None]
    monkeypatch.setattr(adapter_module, "vllm_lora_ranks", lambda: VLLM_LORA_RANKS)  # vLLM not imported
    for change, message in (({"r": 1024}, "rank 1024 is past vLLM's largest max_lora_rank (512)"),
                            ({"use_dora": True}, "use_dora: vLLM serves no DoRA adapter")):
        adapter = moved(dirs, tmp_path / str(len(message)), str(dirs.base))
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=re.escape(f"{adapter}/adapter_config.json: {message}")):
            model_source(SimpleNamespace(model=str(adapter), base="", engine="vllm"))
        assert model_source(SimpleNamespace(model=str(adapter), base="", engine="torch")).adapter is not None


def test_vllm_starts_on_the_base_with_lora_and_names_the_adapter_in_every_generate(dirs):
    from flashdapo.config import DataConfig
    from flashdapo.data import load_prompts
    from flashdapo.distributed.mesh import init_distributed, shutdown
    from flashdapo.eval.command import eval_engine
    from flashdapo.eval.sampling import EvalSampling, sample_prompts
    from flashdapo.reward import dapo_verify
    from flashdapo.tokenizer import load_tokenizer
    from tests.helpers.vllm_double import FakeLLM, fake_vllm

    class LoRARequest(SimpleNamespace):
        def __init__(self, lora_name, lora_int_id, lora_path):
            super().__init__(lora_name=lora_name, lora_int_id=lora_int_id, lora_path=lora_path)

    class RecordingLLM(FakeLLM):
        def generate(self, prompts, sampling_params=None, **kwargs):
            self.requests = [*getattr(self, "requests", []), kwargs.get("lora_request")]
            return super().generate(prompts, sampling_params, **kwargs)

    vllm = fake_vllm(RecordingLLM)
    vllm.lora = SimpleNamespace(request=SimpleNamespace(LoRARequest=LoRARequest))
    args = SimpleNamespace(engine="vllm", model=str(dirs.adapter), base="", tensor_parallel_size=1,
                           max_prompt_length=64, max_new_tokens=6, seed=3)
    env = init_distributed("cpu")
    try:
        tokenizer = load_tokenizer(str(dirs.base))
        engine = eval_engine(args, env, tokenizer, vllm_module=vllm)
        prompts = load_prompts([str(dirs.data)], tokenizer, DataConfig(dedup=True)).prompts
        sample_prompts(engine, prompts, tokenizer, dapo_verify, EvalSampling(k=2, max_new_tokens=6,
                                                                             prompts_per_call=2))
    finally:
        shutdown()
    init = engine.llm.init_kwargs
    assert init["model"] == str(dirs.base) and "load_format" not in init
    assert (init["enable_lora"], init["max_loras"], init["max_lora_rank"]) == (True, 1, 8)
    requests = engine.llm.requests
    assert len(requests) == 2 and all(r == requests[0] for r in requests)
    assert requests[0].lora_int_id == 1
    # The adapter's norms (modules_to_save), which vLLM's LoRA refuses, went into the base by load_weights; the
    # request names a copy of the adapter without them.
    served = Path(requests[0].lora_path)
    assert served != dirs.adapter.resolve() and json.loads((served / "adapter_config.json").read_text())[
        "modules_to_save"] is None
    kept = load_file(served / "adapter_model.safetensors")
    given = load_file(dirs.adapter / "adapter_model.safetensors")
    assert set(kept) == {n for n in given if ".lora_" in n} and len(given) - len(kept) == 3
    loaded = {name: tensor for name, _, _, tensor in engine.llm.model.loads}
    assert set(loaded) == {"model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                           "model.norm.weight"}
    for name, tensor in loaded.items():
        assert torch.equal(tensor, given[f"base_model.model.{name}"])

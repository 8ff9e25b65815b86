"""Checks before any work (flashdapo/preflight.py): the model's architecture, its tokenizer against its embedding,
positions against the token budget, a chat template; the launch (devices, packages, ranks); and `auto` dtype.
Models are built from configs and saved to tmp_path; the tokenizer is the toy task's, trained locally."""

from __future__ import annotations

import json

import pytest
from transformers import (
    AutoModelForCausalLM,
)

from flashdapo.__main__ import main
from flashdapo.config import PRESET_CLUSTERS, Config, ConfigError, ToyTaskConfig, merge, preset
from flashdapo.data import chat_ids
from flashdapo.models.hf import SUPPORTED_MODEL_TYPES
from flashdapo.models.model_dir import ModelDirError
from flashdapo.preflight import (
    PLAIN_CHAT_TEMPLATE,
    _check_vocabulary,
    check_launch,
    check_layout,
    check_model,
    installed,
    resolve_auto,
)
from flashdapo.tasks.toy import build_toy_tokenizer
from tests.helpers.data_files import train_file
from tests.helpers.model_dirs import model_dir

TINY_RUN = ["--trainer.total-steps", "1", "--trainer.train-batch", "2", "--trainer.gen-batch", "2",
            "--trainer.mini-batch", "2", "--rollout.n", "2", "--rollout.max-response-length", "4",
            "--algorithm.overlong-buffer-len", "2", "--algorithm.dynamic-sampling", "false",
            "--trainer.val-before-train", "false", "--logging.plot", "false", "--logging.progress", "false",
            "--data.max-prompt-length", "32", "--checkpoint.export-hf", "false"]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("model_type", [t for t in SUPPORTED_MODEL_TYPES if t != "qwen2"])
def test_every_supported_architecture_trains_a_step(model_type, tmp_path, capsys, monkeypatch):
    """qwen2 is the toy model's own architecture (every trainer test); the others train one step here. The
    llama model's tokenizer has no chat template: the plain one is used, said once."""
    monkeypatch.setenv("FLASHDAPO_DEBUG", "1")
    no_template = model_type == "llama"
    model = model_dir(tmp_path / "m", model_type, chat_template=not no_template)
    argv = ["train", "--model.path", str(model), "--data.train-files", str(train_file(tmp_path / "d.jsonl")),
            "--logging.run-dir", str(tmp_path / "run"), *TINY_RUN]
    assert main(argv) == 0  # model.attn_implementation auto: eager for GPT-OSS and capped Gemma 2, said once
    out = capsys.readouterr().out
    assert out.count("model.attn_implementation auto: eager") == (model_type in ("gpt_oss", "gemma2")), out
    assert out.count("the tokenizer has no chat template") == (1 if no_template else 0), out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and "actor/pg_loss" in rows[0]


def _gpt2(tmp):
    return model_dir(tmp / "m", "gpt2"), "model_type 'gpt2' (GPT2LMHeadModel) is not supported; supported: " + \
        ", ".join(SUPPORTED_MODEL_TYPES)


def _pad_outside_embedding(tmp):
    def move_pad(path):
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["pad_token"] = "<|fresh_pad|>"  # a new special token: id len(vocab), past the embedding
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok_size = len(build_toy_tokenizer(ToyTaskConfig()))
    return (model_dir(tmp / "m", tokenizer_edit=move_pad),
            f"the tokenizer has {tok_size + 1:,} tokens but the model's embedding has {tok_size:,} rows")


def _eos_outside_embedding(tmp):
    tok = build_toy_tokenizer(ToyTaskConfig())
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # An embedding that ends before the tokenizer's special tokens, whose vocabulary still fits: the tokenizer
    # model's ordinary tokens are cut off too.
    return (model_dir(tmp / "m", vocab_size=eos), f"the tokenizer has {len(tok):,} tokens but the model's "
            f"embedding has {eos:,} rows")


def _too_few_positions(tmp):
    return (model_dir(tmp / "m", positions=32),
            "data.max_prompt_length + rollout.max_response_length = 36 tokens > max_position_embeddings=32")


def _no_model_type(tmp):
    path = model_dir(tmp / "m", "gemma2")
    config = json.loads((path / "config.json").read_text())
    del config["model_type"]
    (path / "config.json").write_text(json.dumps(config))
    return path, (f"{path / 'config.json'}: model_type: missing (the file names Gemma2ForCausalLM); expected the "
                  "family's model_type, one of qwen2, ")


def _index_naming_a_missing_shard(tmp):
    path = model_dir(tmp / "m")
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path, (f"{path / 'model.safetensors.index.json'}: weight_map names shard model-00002-of-00002.safetensors, "
                  f"which is not in {path}; copy the whole checkpoint")


@pytest.mark.parametrize("case", [_gpt2, _pad_outside_embedding, _eos_outside_embedding, _too_few_positions,
                                  _no_model_type, _index_naming_a_missing_shard],
                         ids=lambda c: c.__name__.strip("_"))
def test_a_model_the_run_cannot_use_is_one_line_before_its_weights_load(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHDAPO_DEBUG", "0")
    model, expected = case(tmp_path)
    capsys.readouterr()  # saving the model printed a progress bar
    loads = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a))
    argv = ["train", "--model.path", str(model), "--data.train-files", str(train_file(tmp_path / "d.jsonl")),
            "--logging.run-dir", str(tmp_path / "run"), *TINY_RUN]
    assert main(argv) == 1
    err = _error_line(capsys)
    assert err.startswith("flashdapo: error: ") and expected in err, err
    assert not loads


class _Tokenizer:
    """What the vocabulary check reads of a tokenizer: its size, pad and eos ids."""

    def __init__(self, size: int, pad: int, eos: int):
        self.size, self.pad_token_id, self.eos_token_id = size, pad, eos

    def __len__(self):
        return self.size

    def get_vocab(self):
        return {}


@pytest.mark.parametrize(("pad", "eos", "expected"), [(9, 3, "pad token id 9"), (3, 8, "eos token id 8")])
def test_a_special_token_id_outside_the_embedding_is_named(pad, eos, expected):
    with pytest.raises(ModelDirError, match=f"model.path=m: the tokenizer's {expected} is outside the model's "
                                            "embedding"):
        _check_vocabulary(_Tokenizer(8, pad, eos), {"vocab_size": 8}, "model.path=m")  # rows 0..7
    _check_vocabulary(_Tokenizer(8, 7, 6), {"vocab_size": 8}, "model.path=m")


def test_eval_runs_the_same_model_checks(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHDAPO_DEBUG", "0")
    model, expected = _gpt2(tmp_path)
    capsys.readouterr()
    argv = ["eval", "--model", str(model), "--data", str(train_file(tmp_path / "d.jsonl")), "--out",
            str(tmp_path / "o"), "--max-new-tokens", "4", "--max-prompt-length", "16", "--no-progress"]
    assert main(argv) == 1
    err = _error_line(capsys)
    assert err.startswith("flashdapo: error: --model=") and expected in err


def test_a_tokenizer_without_chat_template_gets_the_plain_one(tmp_path):
    checked = check_model(str(model_dir(tmp_path / "m", chat_template=False)), "model.path", 36, "budget")
    assert checked.tokenizer.chat_template == PLAIN_CHAT_TEMPLATE and len(checked.notes) == 1
    ids = chat_ids(checked.tokenizer, [{"role": "user", "content": "Compute 1+2."}])
    assert checked.tokenizer.decode(ids) == "User: Compute 1+2.\n\nAssistant:"
    kept = check_model(str(model_dir(tmp_path / "k")), "model.path", 36, "budget")
    assert kept.tokenizer.chat_template != PLAIN_CHAT_TEMPLATE and not kept.notes


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_eval_refuses_a_budget_past_the_positions_as_train_does(tmp_path, capsys, monkeypatch, engine):
    monkeypatch.setenv("FLASHDAPO_DEBUG", "0")
    model = model_dir(tmp_path / "m", positions=32)
    capsys.readouterr()
    argv = ["eval", "--model", str(model), "--data", str(train_file(tmp_path / "d.jsonl")), "--out",
            str(tmp_path / "o"), "--max-new-tokens", "8", "--max-prompt-length", "32", "--engine", engine,
            "--no-progress"]
    if engine == "vllm" and not installed("vllm"):
        pytest.skip("vLLM is not installed")
    assert main(argv) == 1
    assert _error_line(capsys).strip() == (f"flashdapo: error: --max-prompt-length + --max-new-tokens = 40 tokens > "
                                   f"max_position_embeddings=32 of {model}/config.json (the model has no positions "
                                   "beyond); lower them to fit")
    assert not (tmp_path / "o" / "samples.jsonl").exists()


# ---------------------------------------------------------------------------------------------------
# The launch


def _run(capsys, monkeypatch, tmp_path, *args: str) -> str:
    monkeypatch.setenv("FLASHDAPO_DEBUG", "0")
    capsys.readouterr()
    assert main(["train", *args, "--logging.run-dir", str(tmp_path / "run"), "--model.toy.sft-steps", "0"]) == 2
    err = _error_line(capsys)
    assert err.startswith("flashdapo: config error: "), err
    return err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(("args", "expected"), [
    (["--trainer.device", "cuda"], "trainer.device: 'cuda' but no CUDA GPU is available"),
    (["--model.attn-implementation", "flash_attention_2"], "model.attn_implementation: 'flash_attention_2' needs a "
                                                           "CUDA GPU; use 'auto' on a CPU"),
    (["--trainer.fsdp-cpu-offload", "true"], "trainer.fsdp_cpu_offload: true offloads a GPU's parameters to host "
                                             "memory, and this run has no GPU"),
])
def test_gpu_only_settings_on_a_cpu_are_one_line(args, expected, tmp_path, capsys, monkeypatch):
    assert expected in _run(capsys, monkeypatch, tmp_path, *args)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_triton_on_a_cpu_needs_the_interpreter(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = _run(capsys, monkeypatch, tmp_path, "--trainer.kernel-impl", "triton")
    assert "trainer.kernel_impl: 'triton' needs a CUDA GPU (or TRITON_INTERPRET=1" in err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_launch(merge(preset("toy"), {"trainer": {"kernel_impl": "triton"}}))  # the tests' interpreter: allowed


def test_vllm_without_vllm_is_one_line_in_train_and_eval(tmp_path, capsys, monkeypatch):
    import flashdapo.preflight as preflight

    monkeypatch.setattr(preflight, "installed", lambda module, real=preflight.installed: module != "vllm" and real(module))
    model, data = model_dir(tmp_path / "m"), train_file(tmp_path / "d.jsonl")
    err = _run(capsys, monkeypatch, tmp_path, "--rollout.engine", "vllm", "--model.path", str(model),
               "--data.train-files", str(data))
    assert "rollout.engine: 'vllm' but vLLM is not installed; pip install 'flashdapo[gpu]'" in err
    capsys.readouterr()
    assert main(["eval", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "o"), "--engine",
                 "vllm"]) == 2
    assert "flashdapo: config error: eval.engine: 'vllm' but vLLM is not installed" in _error_line(capsys)


@pytest.mark.skipif(installed("wandb"), reason="wandb is installed")
def test_wandb_asked_for_and_missing_stops_at_start(tmp_path, capsys, monkeypatch):
    err = _run(capsys, monkeypatch, tmp_path, "--logging.wandb", "true")
    assert "logging.wandb: true needs the wandb package (pip install wandb); or set it false" in err


@pytest.mark.parametrize("name", ["train_batch", "gen_batch"])
def test_batches_the_ranks_cannot_share_are_one_line(name, tmp_path, capsys, monkeypatch):
    sizes = {"train_batch": "6", "gen_batch": "6", "mini_batch": "3"}
    sizes[name] = "9"
    if name == "train_batch":
        sizes["mini_batch"] = "3"
    monkeypatch.setenv("WORLD_SIZE", "2")  # before the process group: nothing starts
    args = [a for k, v in sizes.items() for a in (f"--trainer.{k.replace('_', '-')}", v)]
    err = _run(capsys, monkeypatch, tmp_path, *args)
    sharers = "generating ranks" if name == "gen_batch" else "data-parallel slots"
    assert f"trainer.{name}: {sizes[name]} prompts cannot be shared by 2 {sharers}" in err


def test_a_mini_batch_with_fewer_responses_than_slots_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    err = _run(capsys, monkeypatch, tmp_path, "--trainer.train-batch", "4", "--trainer.gen-batch", "4",
               "--trainer.mini-batch", "1", "--rollout.n", "2")
    assert ("trainer.mini_batch: 1 prompts x rollout.n 2 = 2 responses per optimizer step cannot give each of 4 "
            "data-parallel slots (4 ranks) one; use at least 2 prompts") in err


def test_a_model_without_train_files_is_refused(tmp_path, capsys, monkeypatch):
    err = _run(capsys, monkeypatch, tmp_path, "--model.path", str(model_dir(tmp_path / "m")))
    assert f"data.train_files: empty with model.path={tmp_path / 'm'}; the built-in toy task is for the toy model" in err


def test_model_dtype_auto_is_bf16_on_cuda_and_fp32_on_a_cpu():
    for name in ("toy", "qwen2.5-7b-math", "qwen2.5-32b-dapo"):
        assert preset(name).model.dtype == "auto"
        assert resolve_auto(preset(name), on_gpu=False).model.dtype == "float32"
        assert resolve_auto(preset(name), on_gpu=True).model.dtype == "bfloat16"
    assert resolve_auto(merge(Config(), {"model": {"dtype": "bfloat16"}}), on_gpu=False).model.dtype == "bfloat16"
    with pytest.raises(ConfigError):
        merge(Config(), {"model": {"dtype": "float16"}})


@pytest.mark.parametrize(("dtype", "saved"), [("bfloat16", "bfloat16"), ("float32", "float32")])
def test_the_exports_config_says_the_dtype_of_its_tensors(dtype, saved, tmp_path):
    """bf16 runs export bf16 tensors (Run.full_state_dict): their config.json must say bfloat16, not the fp32
    of the master weights the policy was loaded in."""
    import types

    import torch
    from safetensors.torch import load_file

    from flashdapo.config import ModelConfig
    from flashdapo.sync import policy_weights
    from flashdapo.tasks.toy import build_toy_model
    from flashdapo.trainer.setup import Run
    from flashdapo.trainer.state.export import export_hf

    tok = build_toy_tokenizer(ToyTaskConfig())
    hf = build_toy_model(ModelConfig(), len(tok), 64, seed=0)
    before = hf.config.dtype
    run = types.SimpleNamespace(policy=types.SimpleNamespace(config=hf.config, hf=hf),
                                cfg=merge(Config(), {"model": {"dtype": dtype}}))
    export_hf(policy_weights(hf, dtype).export(), Run.export_config(run), tok, tmp_path / "export", True)
    tensors = load_file(tmp_path / "export" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {getattr(torch, saved)}
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dtype"] == saved
    assert hf.config.dtype == before  # the live policy's config is left alone


# ---------------------------------------------------------------------------------------------------
# The launch layout at the documented cluster sizes (no GPU needed: the layout checks read the config only)


@pytest.mark.parametrize(("name", "cluster"), [(n, c) for n, clusters in PRESET_CLUSTERS.items() for c in clusters],
                         ids=lambda v: v if isinstance(v, str) else f"{v.nodes}x{v.gpus_per_node}")
def test_every_preset_launches_at_its_documented_cluster(name, cluster):
    check_layout(preset(name), cluster.world_size)


def test_the_32b_recipe_shares_its_batches_over_data_parallel_slots_not_ranks():
    cfg = preset("qwen2.5-32b-dapo")
    assert cfg.trainer.sequence_parallel == 8 and cfg.trainer.mini_batch == 32
    for world in (64, 128, 256, 512):  # 8, 16, 32, 64 slots of 8 sequence-parallel ranks
        check_layout(cfg, world)
    # A mini-batch's responses are dealt to the slots: 32 prompts x 16 = 512 responses give 64 slots 8 each;
    # 2 prompts x 16 = 32 leave half of them idle at every optimizer step.
    with pytest.raises(ConfigError, match=r"trainer.mini_batch: 2 prompts x rollout.n 16 = 32 responses per "
                                          r"optimizer step cannot give each of 64 data-parallel slots \(512 ranks / "
                                          r"sequence_parallel 8\) one; use at least 4 prompts"):
        check_layout(merge(cfg, {"trainer": {"mini_batch": 2}}), 512)
    with pytest.raises(ConfigError, match="trainer.sequence_parallel: 8 does not divide the world size 12"):
        check_layout(cfg, 12)
    with pytest.raises(ConfigError, match="trainer.gen_batch: 1536 prompts cannot be shared by 1024 generating ranks"):
        check_layout(merge(cfg, {"trainer": {"sequence_parallel": 32}}), 1024)


def test_without_sequence_parallelism_every_rank_is_a_slot():
    cfg = merge(preset("qwen2.5-7b-math"), {"trainer": {"train_batch": 96, "gen_batch": 96, "mini_batch": 12},
                                            "rollout": {"n": 2}})
    check_layout(cfg, 24)  # 12 x 2 = 24 responses a mini-batch: one per slot
    with pytest.raises(ConfigError, match=r"trainer.mini_batch: 12 prompts x rollout.n 2 = 24 responses per optimizer "
                                          r"step cannot give each of 32 data-parallel slots \(32 ranks\) one; use at "
                                          r"least 16 prompts"):
        check_layout(cfg, 32)
    with pytest.raises(ConfigError, match=r"trainer.train_batch: 96 prompts cannot be shared by 64 data-parallel "
                                          r"slots \(64 ranks\)"):
        check_layout(merge(cfg, {"trainer": {"gen_batch": 192}}), 64)


def test_the_7b_preset_plans_on_16_nodes_of_8():
    """128 slots: its mini-batch of 16 prompts x 16 responses gives each slot 2 responses to train on."""
    cfg = preset("qwen2.5-7b-math")
    assert (cfg.trainer.mini_batch, cfg.rollout.n, cfg.trainer.train_batch) == (16, 16, 128)
    check_layout(cfg, 128)
    with pytest.raises(ConfigError, match=r"trainer.train_batch: 128 prompts cannot be shared by 256 data-parallel"):
        check_layout(merge(cfg, {"trainer": {"gen_batch": 512}}), 256)

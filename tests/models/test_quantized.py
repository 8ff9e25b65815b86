"""Quantized checkpoints as released (models/quantized.py): a tiny Qwen3 in the fine-grained fp8 format (16 x 16
blocks, intermediate size 72: edge blocks cut) and a tiny GPT-OSS with MXFP4 experts (tests/helpers/quantized_dirs.py),
each beside its dequantized twin (a plain directory of the same values).

- the dequantization equals transformers' own (its fp8 block and MXFP4 code) where transformers takes the tensors;
- the loaded policy's log-probs equal transformers' float64 forward of the twin (1e-4), packed and padded;
- `flashdapo train --model.path` trains 2 steps on 1 rank (packed; fp8 also padded), saying the dequantization in
  one line, and its export (no quantization_config) reloads in plain transformers to the trained weights; on 2 FSDP2
  ranks under torchrun (slow, distributed);
- `flashdapo plan` counts the plain model; an unsupported quant_method is refused in one line, and so is vLLM
  loading one from disk on a CPU (eval, generate); training's vLLM builds the model plain and takes the pushed
  weights, every push checked (slow, vllm).

Wall time here (2 cores shared with other test runs, 2026-12-07): 37-71 s for the 11 tests without the slow ones, by
the load; the 3 torchrun launches (slow) 32-79 s each (the whole file with them: 192 s)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flashdapo.errors import ConfigError
from flashdapo.models.packing import use_packed_attention
from flashdapo.models.policy import PolicyModel, per_token_split
from flashdapo.models.quantized import (
    QuantFormat,
    QuantizedCheckpointError,
    dequantize_fp8,
    dequantize_mxfp4,
    load_pretrained,
    quant_format,
)
from flashdapo.rollout.engine_models import check_engine_model
from flashdapo.trainer.loop import train
from tests.helpers.family_configs import VOCAB
from tests.helpers.quantized_dirs import fp8_qwen3_dir, mxfp4_gpt_oss_dir, quantize_fp8, quantize_mxfp4
from tests.helpers.runs import torchrun
from tests.helpers.vllm_runs import run_checked

TEMPERATURE = 0.7
ATTENTION = {"fp8": "sdpa", "mxfp4": "eager"}  # GPT-OSS: eager (its sinks)
LINE = {"fp8": "fp8 (block 16x16) checkpoint, dequantized to float32 for training: ",
        "mxfp4": "mxfp4 (32-value blocks, e8m0 scales) checkpoint, dequantized to float32 for training: "}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("quantized")
    return {"fp8": fp8_qwen3_dir(root / "fp8", root / "fp8_twin"),
            "mxfp4": mxfp4_gpt_oss_dir(root / "mxfp4", root / "mxfp4_twin")}


def test_the_dequantization_equals_transformers_own():
    """fp8 blocks: transformers' Fp8Dequantize (whole blocks only) on a 32 x 48 weight in 16 x 16 blocks; the edge
    blocks of a 40 x 24 weight against the helper's block-by-block values. MXFP4: transformers'
    convert_moe_packed_tensors (GPT-OSS's layout: [E, rows, G, 16] -> [E, G * 32, rows])."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    q, scale, _ = quantize_fp8(torch.randn(32, 48, generator=g))
    theirs = Fp8Dequantize(None)._dequantize_one(q, scale, torch.float32)
    assert torch.equal(dequantize_fp8(q, scale, (16, 16)), theirs)
    q, scale, expected = quantize_fp8(torch.randn(40, 24, generator=g))
    assert scale.shape == (3, 2)
    assert torch.equal(dequantize_fp8(q, scale, (16, 16)), expected)
    with pytest.raises(QuantizedCheckpointError, match="weight_scale_inv has shape"):
        dequantize_fp8(q, scale[:2], (16, 16))
    blocks, scales, expected = quantize_mxfp4(torch.randn(3, 64, 40, generator=g))
    ours = dequantize_mxfp4(blocks, scales)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(ours, expected) and ours.shape == (3, 64, 40)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_the_loaded_policy_gives_the_dequantized_twins_log_probs(dirs, fmt):
    """The policy of the quantized directory (float32, packed and padded) against transformers' float64 (GPT-OSS:
    float32, its fused experts take no float64) eager forward of the twin, each sequence alone: 1e-4."""
    path, twin = dirs[fmt]
    lines = []
    model = load_pretrained(path, torch.float32, ATTENTION[fmt], lines.append)
    assert len(lines) == 1 and LINE[fmt] in lines[0] and "\n" not in lines[0]
    assert not hasattr(model.config, "quantization_config")
    dtype = torch.float32 if fmt == "mxfp4" else torch.float64
    reference = AutoModelForCausalLM.from_pretrained(twin, dtype=dtype, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (5, 1, 9)]
    responses = [torch.randint(3, VOCAB, (n,), generator=g) for n in (7, 11, 2)]
    with torch.no_grad():
        expected = []
        for p, r in zip(prompts, responses):
            logits = reference(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1:-1].double()
            expected.append(torch.log_softmax(logits / TEMPERATURE, -1).gather(1, r[:, None]).squeeze(1))
        for layout in ("padded", "packed"):
            policy = PolicyModel(model.eval(), ATTENTION[fmt], "naive", TEMPERATURE)
            if layout == "packed":
                policy.pack = True
                use_packed_attention(model)
            batch = policy.token_batch(prompts, responses, torch.device("cpu"))
            for i, (lp, ref) in enumerate(zip(per_token_split(policy(batch)[0].double(), batch), expected)):
                torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0, msg=f"{fmt} {layout} {i}")


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a}+{a + 1}", "answer": str(2 * a + 1)}) + "\n" for a in range(8)))
    return data


def _fields(model: Path, tmp_path: Path, run: Path) -> list[str]:
    """`flashdapo train` fields of 2 steps on 8 addition problems at the smallest batch (tests/helpers/runs.py
    train_two_steps_on's)."""
    return ["--model.path", str(model), "--data.train-files", str(_data(tmp_path)), "--data.max-prompt-length", "32",
            "--rollout.max-response-length", "8", "--rollout.n", "2", "--trainer.train-batch", "2",
            "--trainer.gen-batch", "2", "--trainer.mini-batch", "1", "--trainer.micro-batch-tokens", "64",
            "--trainer.total-steps", "2", "--trainer.val-every", "0", "--trainer.val-before-train", "False",
            "--algorithm.dynamic-sampling", "False", "--checkpoint.save-every", "0", "--logging.plot", "False",
            "--logging.progress", "False", "--logging.run-dir", str(run)]


def _check_export(export: Path, weights: dict[str, torch.Tensor] | None, fmt: str, twin: Path) -> None:
    """export/ is a plain checkpoint: no quantization_config; it reloads in transformers, with the twin's tensor
    names, to `weights` (the trained policy's; an untrained tiny model's responses all score alike, so 2 steps may
    leave them the twin's)."""
    config = json.loads((export / "config.json").read_text())
    assert "quantization_config" not in config
    reloaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, attn_implementation=ATTENTION[fmt])
    state = reloaded.state_dict()
    initial = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).state_dict()
    assert state.keys() == initial.keys()
    if weights is not None:
        assert weights.keys() == state.keys()
        for name, tensor in weights.items():
            assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("fmt,pack", [("fp8", True), ("fp8", False), ("mxfp4", True)])
def test_train_two_steps_on_one_rank_says_the_dequantization_and_exports_a_plain_checkpoint(dirs, fmt, pack, tmp_path,
                                                                                            capsys):
    """`flashdapo train --model.path` of the quantized directory (in this process): the start-up line, 2 steps
    (packed; fp8 also padded), the export equal to the trained policy."""
    from flashdapo.config.cli import resolve_config

    path, twin = dirs[fmt]
    run_dir = tmp_path / "run"
    fields = _fields(path, tmp_path, run_dir) + ["--trainer.pack-sequences", str(pack)]
    if fmt == "mxfp4":
        fields += ["--model.attn-implementation", "eager"]
    run = train(resolve_config(fields, "flashdapo train"))
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "dequantized" in line]
    assert said == [f"flashdapo: model.path {path}: {LINE[fmt]}" + said[0].split(LINE[fmt])[1]], out
    assert said[0].endswith(" GiB") and " GiB of weights instead of " in said[0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    from torch.distributed.tensor import DTensor

    # one rank: each FSDP2 shard is the whole tensor
    weights = {name: (t.to_local() if isinstance(t, DTensor) else t).detach().float()
               for name, t in run.policy.hf.state_dict().items()}
    _check_export(run_dir / "export", weights, fmt, twin)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fmt,pack", [("fp8", True), ("fp8", False), ("mxfp4", True)])
def test_train_two_steps_on_two_fsdp2_ranks(dirs, fmt, pack, tmp_path):
    """The same under `torchrun --nproc_per_node=2` (gloo, FSDP2): rank 0 dequantizes and broadcasts into the shards;
    the line said once; the export a plain checkpoint reloading in transformers."""
    path, twin = dirs[fmt]
    run_dir = tmp_path / "run"
    extra = ["--trainer.pack-sequences", str(pack)] + (["--model.attn-implementation", "eager"] if fmt == "mxfp4" else [])
    proc = torchrun(2, "-m", "flashdapo", "train", *_fields(path, tmp_path, run_dir), *extra)
    said = [line for line in proc.stdout.splitlines() if "dequantized" in line]
    assert len(said) == 1 and LINE[fmt] in said[0], proc.stdout
    assert "world size 2" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    _check_export(run_dir / "export", None, fmt, twin)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_plan_counts_the_dequantized_model(dirs, fmt, capsys):
    """`flashdapo plan --model-config` of the quantized config.json counts what its twin's counts: the plain model."""
    from flashdapo.plan.command import plan_main

    counts = []
    for d in dirs[fmt]:
        assert plan_main(["--model-config", str(d / "config.json"), "--data.max-prompt-length", "64",
                          "--rollout.max-response-length", "64"]) == 0
        out = capsys.readouterr().out
        counts.append(re.search(r"([\d,]+ parameters in \d+ tensors)", out).group(1))
    assert counts[0] == counts[1], counts


def test_vllm_loading_a_quantized_checkpoint_from_disk_on_a_cpu_is_refused_in_one_line(dirs):
    """Training's vLLM builds the model plain and takes the pushed weights (accepted; run below); eval and generate
    load the checkpoint from disk, which vLLM's CPU build cannot: one line naming the format, the reason and
    --rollout.engine torch. The torch engine passes either way."""
    for fmt, (path, _twin) in dirs.items():
        config = json.loads((path / "config.json").read_text())
        check_engine_model("torch", config, f"model.path={path}")
        check_engine_model("vllm", config, f"model.path={path}", registry=False)  # training: pushed
        cpu = "refuses fp8 in float32" if fmt == "fp8" else "has no mxfp4 layers"
        with pytest.raises(ConfigError) as err:
            check_engine_model("vllm", config, f"--model={path}", pushed=False)  # eval, generate: from disk
        message = str(err.value)
        assert "\n" not in message and re.search(f"--model={path} is an {fmt}.*cannot load it: its CPU build {cpu}",
                                                 message) and message.endswith("use --rollout.engine torch"), message


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_trains_an_fp8_checkpoint_built_plain_with_every_push_checked(tmp_path):
    """vLLM's CPU build started on the fp8 directory without its quantization_config (plain layers), filled by the
    push of the dequantized policy: the fp32 push check passes (measured 3.8e-6 max |delta logp|) at both pushes."""
    pytest.importorskip("vllm")
    path, _twin = fp8_qwen3_dir(tmp_path / "fp8", tmp_path / "twin", head_dim=32)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(8)))
    argv = ["--model.path", str(path), "--data.train-files", str(data), "--data.max-prompt-length", "64",
            "--rollout.max-response-length", "16", "--rollout.engine", "vllm", "--rollout.n", "4",
            "--trainer.total-steps", "2", "--trainer.train-batch", "4", "--trainer.gen-batch", "4",
            "--trainer.mini-batch", "4", "--logging.run-dir", str(tmp_path / "run"), "--logging.plot", "false"]
    proc = run_checked([sys.executable, "-m", "flashdapo", "train", *argv], timeout=600)
    out = proc.stdout + proc.stderr
    assert LINE["fp8"] in out, out[-3000:]
    checks = re.findall(r"weight push (\d) checked: max \|logp_vllm - logp_trainer\| (\S+),", out)
    assert [n for n, _ in checks] == ["1", "2"] and all(float(v) < 1e-3 for _, v in checks), out[-3000:]


def test_an_unsupported_quantization_is_refused_naming_its_method_and_the_supported_ones(dirs, tmp_path, capsys):
    """quant_method awq (and fp8 without a block size) refused in one line, for every engine, at `flashdapo train`'s
    start (no traceback)."""
    from flashdapo.__main__ import main as cli

    for qc, named in [({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
                      ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without a block size")]:
        with pytest.raises(QuantizedCheckpointError, match=named) as err:
            quant_format({"quantization_config": qc}, "model.path=X")
        assert "\n" not in str(err.value) and "fp8 (block-wise: weight_block_size) and mxfp4" in str(err.value)
    assert quant_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "x") == \
        QuantFormat("fp8", (128, 128))
    path = dirs["fp8"][0]
    awq = tmp_path / "awq"
    awq.mkdir()
    for file in path.iterdir():
        if file.name != "config.json":
            (awq / file.name).symlink_to(file)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (awq / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert cli(["train", *_fields(awq, tmp_path, tmp_path / "run")]) != 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("flashdapo: ") and "quant_method 'awq' is not supported" in lines[0], err


def test_a_quantized_checkpoint_missing_a_tensor_is_refused_naming_it(dirs, tmp_path):
    """A parameter without a tensor in the checkpoint would train from its random init: refused, named."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(dirs["fp8"][0], tmp_path / "fp8")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantizedCheckpointError, match="no tensor for model.norm.weight"):
        load_pretrained(path, torch.float32, "sdpa")

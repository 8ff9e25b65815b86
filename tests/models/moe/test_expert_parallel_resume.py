"""`flashdapo train` of a tiny Qwen3-MoE with trainer.expert_parallel=2 on 2 gloo ranks (the torch engine
sampling through the experts' all-to-all, checkpoints, the HF export): SIGKILLed mid-step and resumed, it
reproduces the uninterrupted run bit for bit."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.data_files import train_file
from tests.helpers.moe import moe_model_dir
from tests.helpers.runs import ROOT, TRAINER_SCRIPTS, run_metrics, subprocess_env, torchrun


def _args(tmp_path):
    model, data = moe_model_dir(tmp_path / "model"), train_file(tmp_path / "train.jsonl", rows=16)
    return ["--model.path", str(model), "--model.attn-implementation", "sdpa", "--data.train-files", str(data),
            "--data.max-prompt-length", "44", "--rollout.max-response-length", "12", "--rollout.n", "4",
            "--rollout.val-n", "2", "--trainer.train-batch", "4", "--trainer.gen-batch", "4",
            "--trainer.mini-batch", "2", "--trainer.micro-batch-tokens", "64", "--trainer.val-every", "0",
            "--trainer.val-before-train", "False", "--algorithm.dynamic-sampling", "False",
            "--logging.plot", "False", "--logging.progress", "False", "--trainer.total-steps", "3",
            "--checkpoint.save-every", "2", "--trainer.expert-parallel", "2"]


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_mid_step_then_resume_reproduces_the_uninterrupted_run_at_expert_parallel_2(tmp_path):
    args = _args(tmp_path)
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    torchrun(2, "-m", "flashdapo", "train", *args, "--logging.run-dir", str(straight))
    # Both ranks SIGKILL themselves inside step 3 (after its rollouts), after the checkpoint of step 2.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(TRAINER_SCRIPTS / "kill_during_step.py"), "3", *args, "--logging.run-dir", str(crashed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=300)
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
    assert [r["step"] for r in run_metrics(crashed)] == [1, 2]
    assert not (crashed / "export").exists()
    torchrun(2, "-m", "flashdapo", "train", *args, "--logging.run-dir", str(crashed), "--checkpoint.resume", "auto")
    assert run_metrics(crashed) == run_metrics(straight)
    final_a = load_file(straight / "export" / "model.safetensors")
    final_b = load_file(crashed / "export" / "model.safetensors")
    assert final_a.keys() == final_b.keys()
    experts = [k for k in final_a if ".mlp.experts." in k]
    assert experts and all(final_a[k].shape[0] == 4 for k in experts if k.endswith("_proj"))  # whole, fused
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)

"""LoRA over real gloo ranks: 2 FSDP2 ranks train the adapters as one process does, the frozen base never
moves; a SIGKILLed run resumed from its adapter-only checkpoint equals the uninterrupted run, on 1 and 2
ranks."""

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.runs import (
    ROOT,
    TINY,
    TRAINER_SCRIPTS,
    run_metrics,
    subprocess_env,
    torchrun,
    torchrun_cmd,
)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_train_the_adapters_as_one_process_and_the_base_stays_frozen(tmp_path):
    runs = {"one": (1, "100000"), "two": (2, "48")}
    for name, (ranks, budget) in runs.items():
        (tmp_path / name).mkdir()
        torchrun(ranks, str(TRAINER_SCRIPTS / "update_equivalence.py"), str(tmp_path / name), budget, "2", "4")
    initial = torch.load(tmp_path / "one" / "initial.pt")
    for tag in ("token-mean_none", "seq-mean-token-mean_token_truncate"):
        one, two = (json.loads((tmp_path / name / f"losses_{tag}.json").read_text()) for name in runs)
        # the tolerances of the full model's test (tests/trainer/test_distributed.py): losses are fp32 sums
        for key in ("pg_loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(two[key]), torch.tensor(one[key]), rtol=1e-5, atol=1e-7)
        p1, p2 = (torch.load(tmp_path / name / f"params_{tag}.pt") for name in runs)
        assert p1.keys() == p2.keys() == initial.keys()
        adapters = [n for n in p1 if ".lora_" in n]
        assert len(adapters) == 2 * 7 * 2  # A and B of 7 linears in each of 2 blocks
        norms = [n for n in p1 if n.endswith("norm.weight")]
        assert len(norms) == 2 * 2 + 1  # trained whole (lora.train_norms "all"): 2 a block and the final one
        for name in p1:  # relative to each tensor's norm
            assert (p2[name] - p1[name]).norm() <= 1e-5 * p1[name].norm(), (tag, name)
            moved = (p1[name] - initial[name]).abs().max().item()
            # adapters (both A and B: B starts non-zero here) and norms moved, the frozen base not by one bit
            assert (moved > 1e-4) if name in adapters + norms else (moved == 0), (tag, name, moved)


LORA = [*TINY, "--lora.rank", "4", "--trainer.total-steps", "4", "--checkpoint.save-every", "2"]


def _sigkilled_then_resumed(tmp_path, ranks: int):
    straight, crashed = tmp_path / f"straight{ranks}", tmp_path / f"crashed{ranks}"
    torchrun(ranks, "-m", "flashdapo", "train", *LORA, "--logging.run-dir", str(straight))
    # SIGKILL inside step 3 (every rank's update), after the checkpoint of step 2 was written.
    cmd = torchrun_cmd(ranks, str(TRAINER_SCRIPTS / "kill_during_step.py"), "3", *LORA, "--logging.run-dir",
                       str(crashed))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=300)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert [r["step"] for r in run_metrics(crashed)] == [1, 2]
    checkpoint = next((crashed / "checkpoints").glob("step_*2"))
    saved = json.dumps(sorted(p.name for p in checkpoint.iterdir()))
    torchrun(ranks, "-m", "flashdapo", "train", *LORA, "--logging.run-dir", str(crashed), "--checkpoint.resume",
             "auto")
    assert run_metrics(crashed) == run_metrics(straight)
    final_a = load_file(straight / "export" / "adapter_model.safetensors")
    final_b = load_file(crashed / "export" / "adapter_model.safetensors")
    assert final_a.keys() == final_b.keys() and len(final_a) == 28 + 5  # the adapters and the trained norms
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    return checkpoint, saved


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_sigkill_then_resume_from_the_adapters_checkpoint_equals_the_uninterrupted_run(tmp_path, ranks):
    checkpoint, files = _sigkilled_then_resumed(tmp_path, ranks)
    assert "rng_rank0.pt" in files
    # the checkpoint holds the adapters and their optimizer state, not the base
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k or k.endswith("norm.weight") for k in model_keys), model_keys[:5]
    assert sum(k.endswith("norm.weight") for k in model_keys) == 5
    assert not [k for k in keys if "base_layer" in k or "embed_tokens" in k]

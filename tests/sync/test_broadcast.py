"""Split placement's weight push over real gloo ranks, through the real code (scripts/broadcast_push.py):

- on a weights bridge declared NCCL (CUDA stood in for on this CPU) the trainer side sends and the rollout
  side receives tensors on the rank's own device only, the receiver thread having made it its current
  device, and the rollout side stages bf16 (the compute dtype) in pinned host memory, bit for bit;
- a push holds, beyond the model, one gathered tensor on a trainer rank other than 0 and one bucket more on
  trainer rank 0: never a copy of the model (measured before this design: 80 MiB on rank 0 and 68 MiB on
  rank 1 for this 64 MiB model; now 16-20 MiB and 8-12 MiB);
- on 2 GPUs (skipped without them), the same over NCCL for real.
"""

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.runs import ROOT, subprocess_env

SCRIPT = ROOT / "tests" / "sync" / "scripts" / "broadcast_push.py"
MIB = 1 << 20


def _run(tmp_path, mode: str, nproc: int, bucket_bytes: int) -> list[dict]:
    env = subprocess_env()
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)  # every tensor its own mapping: freed memory leaves the RSS
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(SCRIPT),
           str(tmp_path), mode, str(bucket_bytes)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.distributed
def test_the_weights_bridge_gets_tensors_on_the_ranks_own_device(tmp_path):
    """1 trainer + 1 rollout rank; buckets of two 8 KiB tensors (two buckets per version: one packed, one a
    tensor alone); two versions."""
    trainer, rollout = _run(tmp_path, "device", 2, 2 * 64 * 64 * 2)
    assert trainer["broadcasts"] == rollout["broadcasts"] == 4
    assert rollout["exact_0"] and rollout["exact_1"] and rollout["dtypes"] == ["torch.bfloat16"]
    assert rollout["pinned_bytes"] == 2 * 3 * 64 * 64 * 2  # every staged byte pinned, bf16
    assert rollout["max_staged"] == 1  # a version taken is no longer staged


@pytest.mark.distributed
def test_a_push_holds_one_bucket_and_one_tensor_not_the_model(tmp_path):
    """2 trainer ranks + 1 rollout rank: a 64 MiB fp32 model of 16 tensors of 4 MiB, buckets of 8 MiB. What a
    push adds to a trainer rank's peak resident memory (after a warm-up push) is the all-gather of one tensor
    (its output and gloo's buffers, up to 3 x 4 MiB measured) and, on rank 0, the bucket being filled."""
    bucket, largest = 8 * MIB, 4 * MIB
    rank0, rank1, rollout = _run(tmp_path, "memory", 3, bucket)
    assert rank0["model"] == 64 * MIB
    assert rank1["extra"] <= 4 * largest, rank1
    assert rank0["extra"] <= bucket + 4 * largest, rank0
    assert rollout["exact_0"] and rollout["exact_1"] and rollout["dtypes"] == ["torch.float32"]


@pytest.mark.cuda
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL weights bridge needs a GPU per rank (2)")
def test_on_gpus_the_rollout_side_stages_bf16_in_pinned_host_memory(tmp_path):
    """1 trainer + 1 rollout rank on 2 GPUs, the bridge NCCL: the memory mode's model, bf16 compute (pushed: 32 MiB
    of 16 tensors of 2 MiB), buckets of 8 MiB. The trainer's CUDA peak over a push: the bucket being filled, one
    gathered tensor and its cast, and a float64 chunk of the checksum (8 MiB)."""
    trainer, rollout = _run(tmp_path, "cuda", 2, 8 * MIB)
    assert rollout["exact_0"] and rollout["exact_1"] and rollout["dtypes"] == ["torch.bfloat16"]
    assert rollout["devices"] == ["cpu"] and rollout["pinned"] is True and rollout["max_staged"] == 1
    assert trainer["extra"] <= 8 * MIB + 8 * MIB + 4 * 2 * MIB, trainer

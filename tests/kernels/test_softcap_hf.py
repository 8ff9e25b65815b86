"""Softcapped log-probs against transformers' own Gemma2ForCausalLM (tiny random config, float64).

Gemma2ForCausalLM.forward caps its logits (final_logit_softcapping c: logits = c tanh(lm_head(h) / c)), and
HF sampling divides those capped logits by the temperature (TemperatureLogitsWarper), as vLLM's sampler does
after its LogitsProcessor(soft_cap=c): cap first, then temperature. Here the model samples a continuation
at T = 0.7; for each sampled token the log-softmax of HF's processed scores (the distribution it sampled
from) must equal token_logprobs(h, W, token, temperature=0.7, softcap=c) on the hidden state that reached
the LM head (captured by a hook: Gemma's norms run in fp32 even in a float64 model, so the hidden state is
taken where HF used it), to fp32 accuracy (generate() keeps its scores in fp32). Then the teacher-forced forward of the whole sequence at two temperatures, with
gradients w.r.t. h and the (untied) LM-head weight through HF's own graph (lm_head, its softcap, then
log_softmax(logits / T)). float64 impls to 1e-12; fp32 impls (torch, Triton, the fused sweep) to fp32's
accuracy at these scales.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_accuracy import TRITON_MARKS

from flashdapo.kernels import token_logprobs
from flashdapo.kernels.fused import fused_token_loss

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, NEW = 101, 6, 12  # 101: prime, not a multiple of any tile or BLOCK_V
CAPS = [5.0, 50.0]  # lm_head weights of std 2: |logits| up to ~70, saturating under 5, nearly linear under 50


def _model(cap: float, tie: bool) -> torch.nn.Module:
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, sliding_window=64,
        final_logit_softcapping=cap, pad_token_id=0, bos_token_id=2, eos_token_id=None, tie_word_embeddings=tie)
    cfg._attn_implementation = "eager"
    model = transformers.Gemma2ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 2.0 if cap < 10 else 0.5)
    return model


class _HeadInputs:
    """Records the hidden states the LM head is applied to (forward pre-hook); `leaf` replaces them by a
    leaf tensor that requires grad, so that dL/dh through HF's own graph can be read."""

    def __init__(self, model, leaf: bool = False):
        self.seen: list[torch.Tensor] = []
        self.leaf = leaf
        self.handle = model.lm_head.register_forward_pre_hook(self._hook)

    def _hook(self, _module, args):
        (h,) = args
        if self.leaf:
            h = h.detach().clone().requires_grad_(True)
        self.seen.append(h)
        return (h,)


def _fp32_tol(h, w, temperature, cap) -> float:
    """fp32 error allowance at this problem's scale: the capped logits and log V, plus a raw logit's rounding
    (eps sum_i |h_i w_vi|) as the cap's slope sech^2 / T passes it on (tests/kernels/kernel_accuracy.py)."""
    eps = 2.0**-23
    x = h @ w.T
    passed = ((h.abs() @ w.abs().T) * torch.cosh(x / cap) ** -2).max().item() / temperature
    return 8 * eps * max(1.0, cap / temperature, math.log(w.shape[0])) + 4 * eps * passed


@pytest.mark.parametrize("cap", CAPS)
def test_sampled_tokens_match_hf_gemma2(cap, seed):
    model = _model(cap, tie=True)
    prompt = torch.randint(3, VOCAB, (1, PROMPT))
    heads = _HeadInputs(model)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                             max_new_tokens=NEW, output_scores=True, return_dict_in_generate=True)
    heads.handle.remove()
    sampled = out.sequences[0, PROMPT:]
    assert len(out.scores) == NEW == len(heads.seen)
    h = torch.cat([seen[0, -1:] for seen in heads.seen])  # the position each step sampled from
    w = model.lm_head.weight.detach()
    # generate() keeps its scores in fp32 (the capped float64 logits cast, then divided by T): fp32 accuracy
    hf = torch.stack([torch.log_softmax(s[0].double(), -1)[t] for s, t in zip(out.scores, sampled)])
    assert out.scores[0].dtype == torch.float32
    assert torch.isfinite(hf).all() and (hf > -math.inf).all(), "every token of the vocabulary stays reachable"
    raw = h @ w.T
    if cap < 10:
        assert raw.abs().max().item() > 4 * cap, "the cap should saturate here"
    tol = 16 * 2.0**-23 * max(1.0, cap / 0.7, math.log(VOCAB))
    for impl in ("naive", "torch"):
        ours = token_logprobs(h, w, sampled, temperature=0.7, softcap=cap, impl=impl)
        assert ours.dtype == torch.float64 and (ours - hf).abs().max().item() <= tol
    if cap < 10:  # HF's scores are the capped logits divided by T, not the logits h W^T / T capped
        wrong = torch.log_softmax(cap * torch.tanh(raw / 0.7 / cap), -1).gather(1, sampled[:, None]).squeeze(1)
        assert (wrong - hf).abs().max().item() > 1e-3


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=TRITON_MARKS), "fused-torch",
                                  pytest.param("fused-triton", marks=TRITON_MARKS)])
@pytest.mark.parametrize("cap", CAPS)
def test_teacher_forced_sequence_matches_hf_gemma2(cap, impl, seed):
    """log p of a whole sequence and its gradients w.r.t. h and W, against HF's graph (float64), at T = 1
    and 0.7; float64 inputs on the torch path (1e-12), fp32 inputs on every path."""
    model = _model(cap, tie=False)
    ids = torch.randint(3, VOCAB, (1, 23))
    targets = ids[0, 1:]
    g = torch.randn(len(targets), dtype=torch.float64)
    g[::4] = 0.0  # masked tokens
    on_gpu = "triton" in impl and torch.cuda.is_available()
    for temperature in (1.0, 0.7):
        model.zero_grad()
        heads = _HeadInputs(model, leaf=True)
        logits = model(ids).logits[0, :-1]
        heads.handle.remove()
        hf = torch.log_softmax(logits / temperature, -1).gather(1, targets[:, None]).squeeze(1)
        (hf * g).sum().backward()
        h_leaf = heads.seen[0]
        h, w = h_leaf.detach()[0, :-1], model.lm_head.weight.detach()
        hf_dh, hf_dw = h_leaf.grad[0, :-1], model.lm_head.weight.grad
        dtypes = (torch.float64, torch.float32) if impl == "torch" else (torch.float32,)
        for dtype in dtypes:
            hh = h.to(dtype).clone().requires_grad_(True)
            ww = w.to(dtype).clone().requires_grad_(True)
            dev_h, dev_w, dev_y = (t.cuda() if on_gpu else t for t in (hh, ww, targets))
            if impl.startswith("fused"):
                gd = g.to(dev_h.device, torch.float32 if dtype == torch.float32 else dtype)
                loss, logp, _ = fused_token_loss(dev_h, dev_w, dev_y, lambda lp, rows, gd=gd: (lp * gd[rows]).sum(),
                                                 temperature=temperature, impl=impl.split("-")[1], softcap=cap)
                loss.backward()
            else:
                logp = token_logprobs(dev_h, dev_w, dev_y, temperature=temperature, impl=impl, softcap=cap)
                (logp * g.to(logp)).sum().backward()
            got = [t.detach().double().cpu() for t in (logp, hh.grad, ww.grad)]
            want = [hf.detach(), hf_dh, hf_dw]
            if dtype == torch.float64:
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * max(1.0, b.abs().max().item()))
                continue
            h32, w32 = h.float().double(), w.float().double()  # the fp32 inputs' own float64 reference
            ref = token_logprobs(h32.clone().requires_grad_(True), w32, targets, temperature=temperature,
                                 softcap=cap, impl="naive")
            assert (got[0] - ref.detach()).abs().max().item() <= _fp32_tol(h32, w32, temperature, cap)
            assert (got[0] - hf.detach()).abs().max().item() <= 1e-5 * max(1.0, cap / temperature)
            for a, b in zip(got[1:], want[1:]):
                assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item(), (a - b).abs().max().item()
            assert (got[1][::4] == 0).all(), "masked tokens get exactly zero gradient"

"""`flashdapo eval` / `generate` sample a family whose attention transformers' SDPA path cannot honour (Gemma 2's
attention-logit cap, GPT-OSS's sinks) with its eager attention: the torch engine's model computes the attention
training computes (eval has no --attn-implementation to refuse)."""

import pytest

from flashdapo.eval.command import eval_attention
from tests.helpers.model_dirs import model_dir


@pytest.mark.parametrize(("model_type", "attention"), [("gemma2", "eager"), ("gpt_oss", "eager"), ("qwen2", "sdpa"),
                                                       ("gemma3_text", "sdpa")])
def test_eval_samples_with_the_attention_the_family_needs(model_type, attention, tmp_path):
    assert eval_attention(str(model_dir(tmp_path / "m", model_type))) == attention


def test_an_uncapped_gemma2_keeps_sdpa(tmp_path):
    assert eval_attention(str(model_dir(tmp_path / "m", "gemma2", attn_logit_softcapping=None))) == "sdpa"

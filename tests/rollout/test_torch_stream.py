"""The torch engine's continuous batching (rollout/torch_stream.py) over a scripted model: every request's
tokens follow its own context across pack rebuilds (carried prefixes included), queued requests join once
half of the pack's rows finished, and a pack's cache holds at most max(horizon, context) tokens past its
context (rows that outlive it move to a new pack)."""

from __future__ import annotations

import torch
from transformers import Qwen2Config

from flashdapo.rollout import Request, SamplingParams, torch_stream
from flashdapo.rollout.torch_engine import left_pad, sample
from flashdapo.rollout.torch_stream import TorchStream

PAD, EOS, VOCAB = 0, 2, 64
CONFIG = Qwen2Config(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)


def countdown(input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
    """A model whose next token is the last input token minus one: token k counts down k-1, ..., 3, EOS (2).
    It reads only the last input position, so a row's output shows which context it was last fed."""
    target = (input_ids[:, -1] - 1).clamp_min(EOS)
    return torch.nn.functional.one_hot(target, VOCAB).float() * 100.0


def stream(max_batch: int) -> TorchStream:
    sampling = SamplingParams(top_k=1, max_new_tokens=64)
    return TorchStream(countdown, sample, CONFIG, sampling, torch.Generator().manual_seed(0), torch.tensor([EOS]),
                       PAD, torch.device("cpu"), left_pad, max_batch, policy="fill")


def run(s: TorchStream) -> dict[int, tuple[int, list[int]]]:
    """Step until nothing is pending: each key's (step it finished at, tokens)."""
    done, step = {}, 0
    while s.pending():
        step += 1
        for c in s.step():
            assert c.finished and not c.truncated
            done[c.key] = (step, c.tokens.tolist())
    return done


def test_requests_join_once_half_the_rows_finished_and_keep_their_context():
    s = stream(max_batch=4)
    # Four rows of 1, 2, 9 and 9 tokens fill the pack; two wait. Token k + 2 asks for k tokens.
    s.submit([Request(key, (5, length + 2), max_new_tokens=64) for key, length in enumerate((1, 2, 9, 9))])
    s.submit([Request(4, (7, 3), max_new_tokens=64), Request(5, (7, 4), max_new_tokens=64)])
    done = run(s)
    for key, length in enumerate((1, 2, 9, 9, 1, 2)):
        assert done[key][1] == [*range(length + 1, 2, -1), EOS], key
    assert [done[k][0] for k in range(4)] == [1, 2, 9, 9]
    # One finished row of four is not enough: the queued ones join after step 2 (the second finished), their
    # first token comes from the rebuild's prefill at step 3.
    assert done[4][0] == 3 and done[5][0] == 4


def test_a_carried_prefix_is_continued_not_resampled():
    s = stream(max_batch=None)
    # A response carried with the prefix (9, 8): the model continues from 8, not from the prompt's 10.
    s.submit([Request(0, (1, 10), prefix=(9, 8), max_new_tokens=62), Request(1, (1, 4), max_new_tokens=64)])
    done = run(s)
    assert done[0][1] == [7, 6, 5, 4, 3, EOS] and done[1][1] == [3, EOS]


def test_rows_outliving_a_short_cache_move_to_a_new_pack(monkeypatch):
    monkeypatch.setattr(torch_stream, "PACK_HORIZON", 4)
    calls = []

    def recording(input_ids, attention_mask, position_ids, cache):
        calls.append((input_ids.shape[1], cache.max_cache_len))
        return countdown(input_ids, attention_mask, position_ids, cache)

    s = stream(max_batch=None)
    s.forward = recording
    s.submit([Request(0, (1, 11), max_new_tokens=64)])  # 9 tokens: 10, 9, ..., 3, EOS
    assert run(s)[0] == (9, [*range(10, 2, -1), EOS])
    prefills = [(width, slots) for width, slots in calls if width > 1]
    # The prompt (2 tokens) with room for 4; after those 4, the 6-token context with room for 6 more.
    assert prefills == [(2, 2 + 4), (6, 6 + 6)]

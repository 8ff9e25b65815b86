"""Prompt files, tokenized datasets and the resumable sharded sampler."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashdapo.config import DataConfig, ToyTaskConfig
from flashdapo.data import (
    DAPO_TEMPLATE,
    DataError,
    PromptSampler,
    chat_ids,
    load_prompts,
    prompts_from_records,
    read_records,
)
from flashdapo.tasks import build_datasets
from flashdapo.tasks.toy import TOY_DATA_SOURCE, build_toy_tokenizer

# The public AIME-2024 set in the DAPO schema (30 problems x 32 copies), as released with DAPO.
AIME = Path(__file__).parent / "data" / "aime-2024.parquet"


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer(ToyTaskConfig())


def dapo_row(problem: str, answer: str, index: int = 0) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
        "__index_level_0__": index,
    }


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------------------------------- reading


def test_read_parquet_dapo_schema(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [dapo_row("What is 1+1?", "2", 0), dapo_row("2*3?", "6", 1)])
    records = read_records(path)
    assert [r.ground_truth for r in records] == ["2", "6"]
    assert records[1].messages == [{"role": "user", "content": DAPO_TEMPLATE.format(problem="2*3?")}]
    assert records[1].source == f"{path}:1" and records[0].data_source == "math_dapo"


def test_read_jsonl_both_schemas(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [dapo_row("p0", "10"), {"problem": "What is 2+2?", "answer": "4"},
                                              {"problem": "What is 3+3?", "answer": 6}])
    records = read_records(path)
    assert [r.ground_truth for r in records] == ["10", "4", "6"]
    assert records[1].messages == [{"role": "user", "content": DAPO_TEMPLATE.format(problem="What is 2+2?")}]
    assert records[2].source == f"{path}:2"


def test_template_wraps_problem():
    text = DAPO_TEMPLATE.format(problem="Find {x}.")
    assert text.startswith("Solve the following math problem step by step. The last line of your response")
    assert "\n\nFind {x}.\n\n" in text and text.endswith('after "Answer:".')


def _bad_parquet_not_list(tmp_path):
    rows = [dict(dapo_row("ok", "1"), prompt="a plain string")]
    return write_parquet(tmp_path / "bad.parquet", rows), "row 0 (0-based)"


def _bad_parquet_empty_prompt(tmp_path):
    rows = [dapo_row("ok", "1"), dict(dapo_row("ok", "1"), prompt=[])]
    return write_parquet(tmp_path / "bad.parquet", rows), "row 1 (0-based)"


def _bad_parquet_null_content(tmp_path):
    rows = [dapo_row("ok", "1"), dapo_row("ok", "1"), dict(dapo_row("ok", "1"), prompt=[{"role": "user", "content": None}])]
    return write_parquet(tmp_path / "bad.parquet", rows), "row 2 (0-based)"


def _bad_parquet_missing_column(tmp_path):
    row = dapo_row("ok", "1")
    del row["reward_model"]
    return write_parquet(tmp_path / "bad.parquet", [row]), "column 'reward_model' is missing"


def _bad_parquet_empty_truth(tmp_path):
    rows = [dapo_row("a", "1"), dapo_row("b", "2"), dapo_row("c", " ")]
    return write_parquet(tmp_path / "bad.parquet", rows), "row 2 (0-based)"


def _bad_jsonl_json(tmp_path):
    return write_jsonl(tmp_path / "bad.jsonl", [{"problem": "a", "answer": "1"}, '{"problem": "b",']), "row 1 (0-based)"


def _bad_jsonl_message(tmp_path):
    rows = [{"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}]
    return write_jsonl(tmp_path / "bad.jsonl", rows), "row 0 (0-based)"


def _bad_jsonl_missing_truth(tmp_path):
    rows = [{"problem": "a", "answer": "1"}, {"problem": "b"}]
    return write_jsonl(tmp_path / "bad.jsonl", rows), "row 1 (0-based)"


def _bad_jsonl_missing_reward(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "x"}]}]
    return write_jsonl(tmp_path / "bad.jsonl", rows), "reward_model.ground_truth"


def _bad_jsonl_keys(tmp_path):
    return write_jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": "1"}]), "row 0 (0-based)"


def _bad_jsonl_blank_line(tmp_path):
    return write_jsonl(tmp_path / "bad.jsonl", [{"problem": "a", "answer": "1"}, "", {"problem": "b", "answer": "2"}]), \
        "row 1 (0-based)"


def _bad_jsonl_absurd_truth(tmp_path):
    rows = [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "9" * 100_001}]
    return write_jsonl(tmp_path / "bad.jsonl", rows), "'answer' has 100,001 characters"


def _missing_file(tmp_path):
    return tmp_path / "absent.parquet", "no such file"


def _unknown_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("problem,answer\n")
    return path, "unknown extension"


def _not_parquet(tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_text("not parquet")
    return path, "cannot read"


@pytest.mark.parametrize("make", [
    _bad_parquet_not_list, _bad_parquet_empty_prompt, _bad_parquet_null_content, _bad_parquet_missing_column, _bad_parquet_empty_truth, _bad_jsonl_json,
    _bad_jsonl_message, _bad_jsonl_missing_truth, _bad_jsonl_missing_reward, _bad_jsonl_keys,
    _bad_jsonl_blank_line, _bad_jsonl_absurd_truth, _missing_file, _unknown_extension, _not_parquet,
])
def test_bad_input_names_file_and_row(tmp_path, make):
    path, expected = make(tmp_path)
    with pytest.raises(DataError) as info:
        read_records(path)
    assert str(path) in str(info.value) and expected in str(info.value)


def test_trailing_blank_lines_are_fine(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"problem": "a", "answer": "1"}) + "\n\n\n")
    assert len(read_records(path)) == 1


# --------------------------------------------------------------------------------------------------- datasets


def test_load_prompts_and_dedup(tmp_path, tok):
    rows = [dapo_row("p0", "0"), dapo_row("p1", "1"), dapo_row("p0", "0"), dapo_row("p0", "0")]
    a = write_parquet(tmp_path / "a.parquet", rows)
    b = write_jsonl(tmp_path / "b.jsonl", [{"problem": "p1", "answer": "1"}, {"problem": "p2", "answer": "2"}])
    kept = load_prompts([str(a), str(b)], tok, DataConfig())
    assert len(kept) == 6
    assert (kept.report.rows, kept.report.duplicates, kept.report.removed) == (6, 3, 0)
    expected = chat_ids(tok, [{"role": "user", "content": DAPO_TEMPLATE.format(problem="p0")}])
    assert kept[0].ids == expected and kept[2].ids == expected and kept[0].ground_truth == "0"

    deduped = load_prompts([str(a), str(b)], tok, DataConfig(dedup=True))
    assert [p.ground_truth for p in deduped.prompts] == ["0", "1", "2"]
    assert [p.source for p in deduped.prompts] == [f"{a}:0", f"{a}:1", f"{b}:1"]
    assert (deduped.report.duplicates, deduped.report.removed) == (3, 3)
    summary = deduped.report.summary()
    assert "\n" not in summary and "6 rows" in summary and "3 unique" in summary and "a.parquet" in summary


def test_chat_ids_is_a_plain_list(tok):
    ids = chat_ids(tok, [{"role": "user", "content": "Compute 1+2."}])
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert tok.decode(ids) == "<|im_start|>user\nCompute 1+2.<|im_end|>\n<|im_start|>assistant\n"


def _records_of_lengths(tok, contents):
    from flashdapo.data import Record

    return [Record([{"role": "user", "content": c}], "1", f"mem:{i}") for i, c in enumerate(contents)]


def test_left_truncation_keeps_last_tokens(tok):
    records = _records_of_lengths(tok, ["short", "a much longer prompt " * 20])
    full = [chat_ids(tok, r.messages) for r in records]
    limit = len(full[0]) + 3
    data = prompts_from_records(records, tok, DataConfig(max_prompt_length=limit))
    assert data[0].ids == full[0] and data[1].ids == full[1][-limit:]
    assert data.report.truncated == 1 and data.report.dropped == 0


def test_drop_and_error_policies(tok):
    records = _records_of_lengths(tok, ["short", "long " * 50, "long " * 50, "tiny"])
    limit = len(chat_ids(tok, records[0].messages))
    data = prompts_from_records(records, tok, DataConfig(max_prompt_length=limit, truncation="drop"))
    assert [p.source for p in data.prompts] == ["mem:0", "mem:3"]
    assert (data.report.dropped, data.report.truncated, data.report.duplicates) == (2, 0, 1)
    with pytest.raises(DataError, match="mem:1"):
        prompts_from_records(records, tok, DataConfig(max_prompt_length=limit, truncation="error"))
    with pytest.raises(DataError, match="every prompt was dropped"):
        prompts_from_records(records[1:3], tok, DataConfig(max_prompt_length=limit, truncation="drop"))


def test_build_datasets(tmp_path, tok):
    train, val = build_datasets(DataConfig(toy=ToyTaskConfig(num_train=50, num_val=8)), tok)
    assert len(train) == 50 and len(val) == 8 and train[0].data_source == TOY_DATA_SOURCE
    path = write_jsonl(tmp_path / "t.jsonl", [{"problem": "p", "answer": "1"}])
    train, val = build_datasets(DataConfig(train_files=[str(path)]), tok)
    assert len(train) == 1 and val is None
    train, val = build_datasets(DataConfig(train_files=[str(path)], val_files=[str(path)]), tok)
    assert len(val) == 1


# --------------------------------------------------------------------------------------------------- sampler


@pytest.fixture(scope="module")
def ten(tok):
    records = _records_of_lengths(tok, [f"q{i}" for i in range(10)])
    return prompts_from_records(records, tok, DataConfig())


def draw(sampler, k):
    return [[p.source for p in sampler.next_batch()] for _ in range(k)]


def test_sampler_deterministic(ten):
    assert draw(PromptSampler(ten, 4, seed=1), 6) == draw(PromptSampler(ten, 4, seed=1), 6)
    assert draw(PromptSampler(ten, 4, seed=1), 6) != draw(PromptSampler(ten, 4, seed=2), 6)
    assert draw(PromptSampler(ten, 5, seed=1, shuffle=False), 2) == [[f"mem:{i}" for i in range(5)],
                                                                     [f"mem:{i}" for i in range(5, 10)]]


def test_sampler_epochs_wrap(ten):
    sampler = PromptSampler(ten, 5, seed=0)
    epoch0 = sum(draw(sampler, 2), [])
    epoch1 = sum(draw(sampler, 2), [])
    assert sorted(epoch0) == sorted(epoch1) == sorted(p.source for p in ten.prompts)
    assert epoch0 != epoch1 and sampler.state_dict()["epoch"] == 2
    spanning = PromptSampler(ten, 4, seed=0)  # 4 + 4 + (2 of epoch 0, 2 of epoch 1)
    flat = sum(draw(spanning, 5), [])
    assert sorted(flat[:10]) == sorted(p.source for p in ten.prompts) and flat[:10] == epoch0
    assert flat[10:] == epoch1[:10]


def test_sampler_shards(ten):
    single = draw(PromptSampler(ten, 4, seed=3), 7)
    ranks = [draw(PromptSampler(ten, 4, seed=3, rank=r, world_size=2), 7) for r in range(2)]
    assert [a + b for a, b in zip(*ranks, strict=True)] == single
    assert all(len(batch) == 2 for batch in ranks[0])
    with pytest.raises(DataError, match="multiple of the world size"):
        PromptSampler(ten, 5, seed=0, world_size=2)
    with pytest.raises(DataError, match="rank"):
        PromptSampler(ten, 4, seed=0, rank=2, world_size=2)


def test_sampler_resume(ten):
    reference = PromptSampler(ten, 4, seed=5)
    draw(reference, 3)
    state = reference.state_dict()
    expected = draw(reference, 4)

    resumed = PromptSampler(ten, 4, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives serialization
    assert draw(resumed, 4) == expected

    shards = [PromptSampler(ten, 4, seed=5, rank=r, world_size=2) for r in range(2)]
    for shard in shards:
        shard.load_state_dict(state)
    assert [a + b for a, b in zip(*(draw(s, 4) for s in shards), strict=True)] == expected

    with pytest.raises(DataError, match="seed"):
        PromptSampler(ten, 4, seed=6).load_state_dict(state)


# --------------------------------------------------------------------------------------------------- AIME 2024


def test_aime_2024(tok):
    records = read_records(AIME)
    assert len(records) == 960 and len({r.messages[0]["content"] for r in records}) == 30
    assert all(r.messages[0]["content"].startswith(DAPO_TEMPLATE.split("{problem}")[0]) for r in records)
    raw = pq.read_table(AIME, columns=["extra_info"]).column("extra_info").to_pylist()
    assert all(r.messages[0]["content"] == DAPO_TEMPLATE.format(problem=x["raw_problem"])
               for r, x in zip(records, raw, strict=True))
    data = load_prompts([str(AIME)], tok, DataConfig(dedup=True))
    assert len(data) == 30 and (data.report.rows, data.report.duplicates, data.report.removed) == (960, 930, 930)


def test_suspicious_rows_are_warned_once_per_file_counted_naming_the_first_row(tmp_path, tok):
    def row(messages, answer="1"):
        return {"prompt": messages, "reward_model": {"ground_truth": answer}}

    user = [{"role": "user", "content": "Compute 1+0."}]
    a = write_jsonl(tmp_path / "a.jsonl", [
        row(user), row([{"role": "user", "content": " "}]), row([{"role": "user", "content": ""}]),
        row([{"role": "human", "content": "hi"}]), row([*user, {"role": "assistant", "content": "Answer: 1"}])])
    b = write_jsonl(tmp_path / "b.jsonl", [row(user, "2"), row(user, "1"), row(user, "3")])
    report = load_prompts([str(a), str(b)], tok, DataConfig()).report
    assert report.warnings == [
        f"{a}: 2 row(s) with an empty user message (first: row 1)",
        f"{a}: 1 row(s) with a role other than system, user, assistant (first: row 3, role 'human')",
        f"{a}: 1 row(s) with a conversation ending in an assistant turn (first: row 4)",
        f"{b}: 2 row(s) with a prompt seen earlier with another ground truth (first: row 0, '2' here, '1' at {a}:0)",
    ]
    clean = write_jsonl(tmp_path / "c.jsonl", [row(user), row(user), row([{"role": "system", "content": "s"}, *user])])
    assert load_prompts([str(clean)], tok, DataConfig()).report.warnings == []


def test_data_warnings_are_logged_at_start(tmp_path, capsys, monkeypatch):
    from flashdapo.__main__ import main

    monkeypatch.setenv("FLASHDAPO_DEBUG", "1")
    data = write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1", "answer": "2"}, {"problem": "1+1", "answer": "3"}])
    import flashdapo.trainer.setup as run

    def stop(*_args):  # the data is loaded and reported: nothing after it is needed here
        raise RuntimeError("stop after the data")

    monkeypatch.setattr(run, "build_policy", stop)
    argv = ["train", "--data.train-files", str(data), "--logging.run-dir", str(tmp_path / "run"),
            "--model.toy.sft-steps", "0"]
    with pytest.raises(RuntimeError, match="stop after the data"):
        main(argv)
    out = capsys.readouterr().out
    assert out.count(f"flashdapo: warning: {data}: 1 row(s) with a prompt seen earlier with another ground truth") == 1

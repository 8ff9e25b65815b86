"""`flashdapo plan` refuses exactly what `flashdapo train` refuses of a model's settings (one shared check,
preflight.check_model_settings), in the same one line: an attention implementation the family cannot run, a
router-loss coefficient or routing replay without routers they apply to, a MoE config.json without its expert
count. And `auto` attention picks what the family needs, saying so."""

import json

import pytest

from flashdapo.__main__ import main
from flashdapo.config import Config, merge
from flashdapo.preflight import resolve_auto
from tests.helpers.data_files import train_file
from tests.helpers.model_dirs import model_dir


def _without_expert_count(path):
    config = json.loads((path / "config.json").read_text())
    for key in ("num_experts", "num_local_experts"):
        config.pop(key, None)
    (path / "config.json").write_text(json.dumps(config))


CASES = {
    "gpt_oss-sdpa": ("gpt_oss", ["--model.attn-implementation", "sdpa"], None,
                     "model.attn_implementation=sdpa: gpt_oss at model.path="),
    "gemma2-sdpa": ("gemma2", ["--model.attn-implementation", "sdpa"], None,
                    "model.attn_implementation=sdpa: gemma2 at model.path="),
    "dense-r3": ("qwen2", ["--algorithm.routing-replay", "r3"], None,
                 "algorithm.routing_replay=r3: the model (qwen2) is dense"),
    "dense-router-loss": ("qwen2", ["--model.router-aux-loss-coef", "0.1"], None,
                          "model.router_aux_loss_coef=0.1: qwen2 is a dense model"),
    "deepseek-router-loss": ("deepseek_v3", ["--model.router-aux-loss-coef", "0.1"], None,
                             "deepseek_v3's routers are not balanced by a load-balancing loss"),
    "deepseek-r3": ("deepseek_v3", ["--algorithm.routing-replay", "r3"], None,
                    "the routers of deepseek_v3 are not softmax top-k routers"),
    "moe-without-expert-count": ("qwen3_moe", [], _without_expert_count,
                                 "num_experts: expected the number of experts, a positive integer, got None (missing"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_refuses_what_train_refuses_in_the_same_line(case, tmp_path, capsys):
    model_type, args, edit, expected = CASES[case]
    path = model_dir(tmp_path / "m", model_type)
    if edit is not None:
        edit(path)
    capsys.readouterr()
    common = ["--model.path", str(path), "--data.train-files", str(train_file(tmp_path / "d.jsonl")),
              "--data.max-prompt-length", "32", "--rollout.max-response-length", "16", *args]
    assert main(["train", *common, "--logging.run-dir", str(tmp_path / "run")]) in (1, 2)  # settings 2, files 1
    train_err = capsys.readouterr().err
    assert main(["plan", *common, "--nodes", "1", "--gpus-per-node", "2"]) == 1
    plan_err = capsys.readouterr().err
    for err in (train_err, plan_err):
        assert err.count("\n") == 1 and expected in err and "Traceback" not in err, err
    assert train_err[train_err.index(expected):] == plan_err[plan_err.index(expected):], (train_err, plan_err)


@pytest.mark.parametrize(("model_type", "attention"), [("gpt_oss", "eager"), ("gemma2", "eager"), ("qwen3", "sdpa")])
def test_auto_attention_is_what_the_family_needs_and_says_so(model_type, attention, tmp_path):
    path = model_dir(tmp_path / "m", model_type)
    lines = []
    cfg = resolve_auto(merge(Config(), {"model": {"path": str(path)}}), on_gpu=False, log=lines.append)
    assert cfg.model.attn_implementation == attention
    assert lines == ([f"model.attn_implementation auto: eager for {model_type} (" + lines[0].split(" (", 1)[1]]
                     if attention == "eager" else [])
    assert resolve_auto(Config(), on_gpu=False).model.attn_implementation == "sdpa"  # the built-in model
    explicit = merge(Config(), {"model": {"path": str(path), "attn_implementation": "eager"}})
    assert resolve_auto(explicit, on_gpu=False).model.attn_implementation == "eager"

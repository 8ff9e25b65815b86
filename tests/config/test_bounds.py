"""Upper bounds of the settings whose huge value would take the machine (allocate or loop without end): each
refused in one line naming the field, the bound and why; the bound itself is accepted."""

from __future__ import annotations

import pytest

from flashdapo.__main__ import main
from flashdapo.config import ConfigError, merge, toy


def _nested(path: str, value) -> dict:
    out: dict = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


# (field, the largest value accepted, why the refusal says)
BOUNDS = [
    ("rollout.agree_every", 1024, "the stop waits for the next agreement"),
    ("rollout.n", 1024, "responses per prompt"),
    ("rollout.val_n", 1024, "samples per prompt"),
    ("rollout.max_response_length", 1 << 20, "beyond any model's positions"),
    ("rollout.max_num_seqs", 1 << 16, "held in memory at once"),
    ("rollout.max_num_batched_tokens", 1 << 20, "beyond any model's positions"),
    ("rollout.max_in_flight", 1 << 16, "held in memory at once"),
    ("rollout.kv_cache_gib", 1024.0, "GiB allocated on each rank"),
    ("rollout.max_lag", 16, "max_lag + 1 copies of the weights"),
    ("data.max_prompt_length", 1 << 20, "beyond any model's positions"),
    ("data.toy.num_train", 10_000_000, "generated up front"),
    ("data.toy.num_val", 1_000_000, "generated up front"),
    ("data.toy.max_operand", 999, "listed up front"),
    ("data.toy.seed", 2**32 - 1, "32-bit"),
    ("data.toy.filler_median", 1000.0, "20 x this many"),
    ("data.toy.filler_sigma", 10.0, "overflows"),
    ("data.scratchpad.num_train", 10_000_000, "generated up front"),
    ("data.scratchpad.num_val", 1_000_000, "generated up front"),
    ("data.scratchpad.seed", 2**32 - 1, "32-bit"),
    ("model.toy.hidden_size", 8192, "toy model"),
    ("model.toy.num_layers", 256, "toy model"),
    ("model.toy.intermediate_size", 32768, "toy model"),
    ("model.toy.sft_steps", 1_000_000, "generated up front"),
    ("model.toy.sft_batch", 65536, "generated up front"),
    ("trainer.total_steps", 10_000_000, "training steps"),
    ("trainer.train_batch", 1 << 16, "held in memory at once"),
    ("trainer.gen_batch", 1 << 16, "held in memory at once"),
    ("trainer.mini_batch", 1 << 16, "held in memory at once"),
    ("trainer.ppo_epochs", 1000, "passes"),
    ("trainer.micro_batch_tokens", 1 << 22, "forward and backward"),
    ("trainer.seed", 2**32 - 1, "32-bit"),
    ("trainer.collective_timeout_s", 7 * 24 * 3600, "a week"),
    ("trainer.setup_timeout_s", 7 * 24 * 3600, "a week"),
    ("logging.heartbeat_s", 86400.0, "a day"),
    ("logging.probe_prompts", 1 << 16, "held in memory at once"),
]


@pytest.mark.parametrize(("path", "bound", "why"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_a_huge_value_is_refused_naming_the_field_the_bound_and_why(path, bound, why):
    over = bound + 1 if isinstance(bound, int) else bound * 2
    with pytest.raises(ConfigError) as refused:
        merge(toy(), _nested(path, over))
    message = str(refused.value)
    shown = f"{bound:,}" if isinstance(bound, int) else f"{bound:,g}"
    assert message.startswith(f"{path}: expected ") and f"at most {shown} (" in message and why in message, message
    assert "\n" not in message


@pytest.mark.parametrize(("path", "bound"), [(p, b) for p, b, _ in BOUNDS
                                             if p not in ("data.toy.num_val", "data.toy.max_operand",
                                                          "model.toy.hidden_size", "model.toy.sft_steps",
                                                          "model.toy.sft_batch", "trainer.mini_batch",
                                                          "trainer.train_batch", "data.scratchpad.num_train",
                                                          "data.scratchpad.num_val")],
                         ids=lambda v: str(v))
def test_the_bound_itself_is_accepted(path, bound):
    """(Bounds that other fields' rules tie to a smaller value, e.g. mini_batch dividing train_batch, are left out.)"""
    cfg = merge(toy(), _nested(path, bound))
    section, _, leaf = path.rpartition(".")
    obj = cfg
    for part in section.split("."):
        obj = getattr(obj, part)
    assert getattr(obj, leaf) == bound


def test_the_warm_up_examples_are_bounded_in_all():
    with pytest.raises(ConfigError, match=r"model.toy.sft_steps: expected at most 10,000,000 examples in all, "
                                          r"sft_steps x sft_batch \(64\)"):
        merge(toy(), {"model": {"toy": {"sft_steps": 200_000, "sft_batch": 64}}})


def test_the_command_line_refuses_agree_every_of_a_billion_in_one_line(capsys):
    assert main(["config", "--rollout.agree-every", "1000000000"]) == 2
    err = capsys.readouterr().err
    assert err == ("flashdapo: config error: rollout.agree_every: expected at most 1,024 (the stop waits for the "
                   "next agreement: more only runs engine steps past the target), got 1000000000\n")


def test_a_config_file_is_bounded_as_the_command_line_is(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  collective_timeout_s: 100000000000\n")
    assert main(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flashdapo: config error: --config {path}: trainer.collective_timeout_s: expected at most "
                          "604,800 (a week") and err.count("\n") == 1, err


def test_the_other_commands_options_are_bounded(tmp_path, capsys, monkeypatch):
    from flashdapo.ablation import command

    # Were a bound missing, the ablation would start (for hours): record the start instead.
    monkeypatch.setattr(command, "run_panels", lambda *a, **k: pytest.fail("the ablation started"))
    assert main(["ablate", "--out", str(tmp_path), "--seeds", "100000"]) == 2
    assert "ablate.seeds: expected at most 1,000 (a training run per arm and seed), got 100000" in \
        capsys.readouterr().err
    assert main(["ablate", "--out", str(tmp_path), "--final-eval-k", "5000"]) == 2
    assert "ablate.final_eval_k: expected at most 1,024" in capsys.readouterr().err
    assert main(["plan", "--mean-response-tokens", "100000000"]) == 2
    assert "plan.mean_response_tokens: expected at most 1,048,576" in capsys.readouterr().err

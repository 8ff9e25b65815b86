"""`flashdapo train --algorithm.routing-replay r3` with the torch engine on a tiny Qwen3-MoE model directory,
streaming dynamic sampling (the random reward keeps about half of the groups; those finished past a step's target
train the next step, their records made by the weights before it): three steps train and log
`moe/route_agreement`, the share of recorded positions x sparse layers where the trainer's own routing equals the
engine's (the engine samples from the policy itself: all of them when the records are this step's, measured
0.98 at step 3); on the built-in dense toy model r3 is refused in one line. Wall budget: 15 s."""

import json

from flashdapo.__main__ import main as cli
from tests.helpers.moe import moe_model_dir

COMMON = ["--data.max-prompt-length", "32", "--rollout.max-response-length", "16", "--rollout.n", "2",
          "--trainer.train-batch", "2", "--trainer.mini-batch", "1", "--trainer.micro-batch-tokens", "64",
          "--trainer.val-every", "0",
          "--trainer.val-before-train", "False", "--checkpoint.save-every", "0", "--logging.plot", "False",
          "--logging.progress", "False", "--algorithm.routing-replay", "r3"]


def test_a_streaming_r3_run_trains_on_a_moe_model_dir(tmp_path):
    model = moe_model_dir(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a}+{a + 1}", "answer": str(2 * a + 1)}) + "\n"
                            for a in range(8)))
    run = tmp_path / "run"
    assert cli(["train", "--model.path", str(model), "--data.train-files", str(data), *COMMON,
                "--trainer.total-steps", "3", "--trainer.gen-batch", "4", "--algorithm.verifier", "random",
                "--rollout.streaming", "True", "--rollout.partial-rollouts", "True",
                "--logging.run-dir", str(run)]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert 0.9 <= row["moe/route_agreement"] <= 1.0, row


def test_r3_on_the_dense_toy_model_is_refused_in_one_line(tmp_path, capsys):
    assert cli(["train", *COMMON, "--trainer.gen-batch", "2", "--trainer.total-steps", "2",
                "--logging.run-dir", str(tmp_path / "run")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any(line.endswith("algorithm.routing_replay=r3: the model (qwen2) is dense (no registered "
                             "mixture-of-experts router to replay); use off") for line in err), err

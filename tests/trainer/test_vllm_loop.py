"""The loop's calls through the rollout contract: a new policy version per update, and a validation that a
training step follows on the same weights lets the engine stay awake (so a co-located vLLM engine pushes
once per set of weights: tests/rollout/test_vllm_engine.py checks that side)."""

import flashdapo.trainer.setup as run_module
from flashdapo.rollout.torch_engine import TorchEngine
from flashdapo.tokenizer import eos_token_ids
from flashdapo.trainer.loop import train
from tests.helpers.runs import tiny_config


class RecordingEngine(TorchEngine):
    """The torch engine, recording the contract's calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def wake(self, weights, version=None):
        self.calls.append(("wake", version))
        super().wake(weights, version)

    def sleep(self, keep_awake=False):
        self.calls.append(("sleep", keep_awake))
        super().sleep(keep_awake)

    def generate(self, prompts, sampling):
        if self.calls[-1] != "generate":  # several generation rounds count once
            self.calls.append("generate")
        return super().generate(prompts, sampling)


def test_validation_leaves_the_weights_for_the_next_step(tmp_path, monkeypatch):
    engines = []

    def build(cfg, env, policy, tokenizer, error_log, log):
        engines.append(RecordingEngine(policy, eos_token_ids(tokenizer), tokenizer.pad_token_id, env.device,
                                       max_batch=cfg.rollout.max_num_seqs))
        return engines[0]

    monkeypatch.setattr(run_module, "training_engine", build)
    cfg = tiny_config(tmp_path, trainer={"total_steps": 2, "val_every": 1, "val_before_train": True})
    train(cfg)
    # Validation at 0 (kept awake for step 1), step 1, validation 1 (kept awake for step 2), step 2, and the
    # last validation (nothing follows: asleep).
    assert engines[0].calls == [
        ("wake", 0), "generate", ("sleep", True), ("wake", 0), "generate", ("sleep", False),
        ("wake", 1), "generate", ("sleep", True), ("wake", 1), "generate", ("sleep", False),
        ("wake", 2), "generate", ("sleep", False)]

"""The loop's calls to a co-located engine: one weight push per new set of weights, none after validation
(a recording engine with VLLMEngine's surface around the torch engine, on the toy task)."""

import flashdapo.trainer.run as run_module
from flashdapo.rollout.torch_engine import TorchEngine
from flashdapo.tokenizer import eos_token_ids
from flashdapo.trainer.loop import train

from .test_loop import tiny_config


class RecordingEngine(TorchEngine):
    """The torch engine, called as the loop calls VLLMEngine (wake_and_sync, sleep)."""

    weight_dtype = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def wake_and_sync(self, named_tensors):
        self.calls.append("push" if sum(1 for _ in named_tensors) else "empty push")

    def sleep(self):
        self.calls.append("sleep")

    def generate(self, prompts, sampling):
        if self.calls[-1] != "generate":  # a validation and the next step's rollouts count once
            self.calls.append("generate")
        return super().generate(prompts, sampling)


def test_validation_leaves_the_weights_for_the_next_step(tmp_path, monkeypatch):
    engines = []

    def build(cfg, env, policy, tokenizer):
        engines.append(RecordingEngine(policy, eos_token_ids(tokenizer), tokenizer.pad_token_id, env.device,
                                       max_batch=cfg.rollout.max_num_seqs))
        return engines[0]

    monkeypatch.setattr(run_module, "_build_engine", build)
    cfg = tiny_config(tmp_path, trainer={"total_steps": 2, "val_every": 1, "val_before_train": True})
    cfg.rollout.engine = "vllm"  # after the config check, which wants model.path for vLLM
    train(cfg)
    # Validation at 0, then steps 1-2 each followed by one: a push per set of weights (3, not 5); asleep
    # after each step's rollouts and after the last validation only.
    assert engines[0].calls == ["push", "generate", "sleep"] * 3

"""Run `flashdapo train ARGS` in split placement with the rollout side's weight load perturbed at one version:
`python split_perturb_push.py VERSION ARGS...` (under torchrun). The load copies the pushed weights, then adds
1e-2 to the tied embedding / LM head of this rank's policy copy, as a stale or corrupt push would leave it."""

import sys

import torch

import flashdapo.trainer.split.rollout_side as split_rollout
from flashdapo.__main__ import main

bad_version = int(sys.argv[1])
real_load = split_rollout.load_weights
loads = {"n": 0}


def perturbed_load(policy, staged):
    real_load(policy, staged)
    if loads["n"] == bad_version:
        with torch.no_grad():
            embed = policy.hf.get_input_embeddings().weight
            (embed.to_local() if hasattr(embed, "to_local") else embed).add_(1e-2)
    loads["n"] += 1


split_rollout.load_weights = perturbed_load
sys.argv = [sys.argv[0], "train", *sys.argv[2:]]
main()

"""Dynamic sampling without a model: `collect` runs the rounds' collect_groups over the scripted engine and
scorer (tests/trainer/scripted.py); the streaming settings, sampler and long-tailed response lengths that
stream_groups' tests run on."""

import dataclasses
import math

import torch

from flashdapo.config import merge, toy
from flashdapo.data import PromptSampler
from flashdapo.distributed.mesh import DistEnv
from flashdapo.profiling import StageTimer
from flashdapo.trainer.collect.rounds import collect_groups
from tests.trainer.scripted import PlainTokenizer, ScriptedEngine, numbered_prompts, scripted_verifier


def collect(informative_ids, num_prompts=12, algorithm=None, trainer=None, keep_generated=False, verifier=None):
    """Step 1's collect_groups on the toy preset (n 4; train_batch, gen_batch 4, mini_batch 2 unless `trainer`
    says otherwise) over prompts 0..num_prompts-1 in order; the groups of `informative_ids` are informative."""
    cfg = toy()
    cfg = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, n=4),
        algorithm=dataclasses.replace(cfg.algorithm, **(algorithm or {})),
        trainer=dataclasses.replace(cfg.trainer, **({"train_batch": 4, "gen_batch": 4, "mini_batch": 2} |
                                                     (trainer or {}))))
    sampler = PromptSampler(numbered_prompts(num_prompts), cfg.trainer.gen_batch, seed=0, shuffle=False)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), mesh=None)
    return collect_groups(1, sampler, ScriptedEngine(), PlainTokenizer(),
                          verifier or scripted_verifier(informative_ids), cfg, env, StageTimer(env.device),
                          keep_generated=keep_generated)


ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), mesh=None)
N = 4
"""rollout.n of the streaming tests."""


def long_tail(prompt: int, member: int) -> int:
    """Heavy-tailed response lengths (3..~90 tokens), fixed per (prompt, member)."""
    u = ((prompt * 7919 + member * 104729) % 1000 + 0.5) / 1000
    return 3 + int(4 * math.exp(2.6 * u ** 3))


def stream_config(carry: bool, **trainer):
    """The toy preset streaming groups of N (carrying unfinished responses over if `carry`), without a bound on
    its generation rounds; train_batch 4, gen_batch 8, mini_batch 4 unless `trainer` says otherwise."""
    return merge(toy(), {"rollout": {"n": N, "streaming": True, "partial_rollouts": carry, "max_carry_steps": 50,
                                     "max_response_length": 200},
                         "algorithm": {"max_gen_batches": 0},
                         "trainer": {"train_batch": 4, "gen_batch": 8, "mini_batch": 4, **trainer}})


def stream_sampler(cfg):
    """Prompts 0..3999 in order, gen_batch at a time."""
    return PromptSampler(numbered_prompts(4000), cfg.trainer.gen_batch, seed=0, shuffle=False)

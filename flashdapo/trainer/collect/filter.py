"""Dynamic sampling's group filter and its shortfall policy, written once for every collector.

A group is informative when its `algorithm.filter_metric` values (acc by default) are not all equal: only
those carry a gradient. When the search for train_batch informative groups ends at algorithm.max_gen_batches
short of the target, `algorithm.on_max_gen_batches` decides: `error` stops the run naming what was found,
`continue` trains on what was found (the largest multiple of the data-parallel slots) with one warning.
"""

from __future__ import annotations

import warnings

import torch

from ...algorithm import informative_groups
from ...config import Config
from ...distributed.mesh import DistEnv
from ...errors import FlashdapoError
from ..batch import Group


class DynamicSamplingError(FlashdapoError, RuntimeError):
    """max_gen_batches rounds did not find train_batch informative groups (on_max_gen_batches=error)."""


def is_informative(group: Group, metric: str) -> bool:
    """Whether the group's filter values (`acc`, or the shaped `score`) are not all equal (or it has one)."""
    values = group.acc if metric == "acc" else group.scores
    return bool(informative_groups(values, torch.zeros(group.size, dtype=torch.long)).all())


def unanimous(group: Group) -> tuple[int, int]:
    """(1, 0) when every response of the group is correct, (0, 1) when every one is wrong, else (0, 0); a
    group of one response is neither (as dynamic sampling keeps it, it is never all-equal either)."""
    if group.size < 2:
        return 0, 0
    return int(bool(group.acc.all())), int(not bool(group.acc.any()))


def check_shortfall(step: int, found: int, search: str, cfg: Config, env: DistEnv) -> None:
    """The search ended with `found` informative groups (over all ranks) after `search` (what it ran, e.g. '3
    generation rounds (24 prompts)'): nothing to do at or past train_batch or without dynamic sampling; else
    DynamicSamplingError (on_max_gen_batches=error) or one warning from the main rank saying what trains."""
    tc, algo = cfg.trainer, cfg.algorithm
    if found >= tc.train_batch or not algo.dynamic_sampling:
        return
    message = (f"step {step}: {'streaming ' if cfg.rollout.streaming else ''}dynamic sampling found {found} "
               f"informative groups in {search}; train_batch needs {tc.train_batch}")
    if algo.on_max_gen_batches == "error":
        raise DynamicSamplingError(message + ". The data may be too easy or too hard for the model: raise "
                                   "algorithm.max_gen_batches, or set algorithm.on_max_gen_batches=continue")
    if env.is_main:
        usable = min(found, tc.train_batch) // env.dp_size * env.dp_size
        warnings.warn(
            message + f"; training on what was found (on_max_gen_batches=continue): {usable} groups "
            f"in {-(-usable // tc.mini_batch)} mini-batches of up to {tc.mini_batch} (instead of "
            f"{tc.train_batch // tc.mini_batch})", stacklevel=3)


UNBOUNDED_WARN_EVERY = 20
"""With max_gen_batches <= 0 (unbounded), warn every this many generation rounds of one step."""
ROUND_LINE_AFTER_S = 10.0
"""A step's extra generation rounds print their progress line once its generation has run this long: a
real run's rounds take minutes and the line says why the step is long; the toy's take 0.2 s and the step
line's `rounds N` says enough."""


def report_round(step: int, rounds: int, kept: int, cfg: Config, elapsed_s: float) -> None:
    """Before each extra generation round: a progress line (logging.progress) once the step's generation has
    run ROUND_LINE_AFTER_S; when unbounded, a warning every UNBOUNDED_WARN_EVERY rounds with the kept rate,
    so a search that cannot end is visible."""
    tc = cfg.trainer
    if cfg.logging.progress and elapsed_s >= ROUND_LINE_AFTER_S:
        print(
            f"flashdapo: step {step}: generation round {rounds + 1}: {kept} of {tc.train_batch} informative "
            "groups kept so far", flush=True)
    if cfg.algorithm.max_gen_batches <= 0 and rounds % UNBOUNDED_WARN_EVERY == 0:
        rate = kept / (rounds * tc.gen_batch)
        outlook = (f"about {-(-(tc.train_batch - kept) * rounds // kept)} more rounds at this rate" if kept
                   else "it may never end")
        warnings.warn(
            f"step {step}: {rounds} generation rounds kept {kept} of {rounds * tc.gen_batch} groups "
            f"({rate:.1%}); train_batch needs {tc.train_batch}: {outlook}. algorithm.max_gen_batches=0 is "
            "unbounded: set it to a bound to stop or continue at that bound", stacklevel=3)


__all__ = ["DynamicSamplingError", "check_shortfall", "is_informative", "report_round", "unanimous"]

"""Run `flashdapo train ARGS` and SIGKILL this process in the middle of step K (after its rollouts,
before its update): `python kill_during_step.py K ARGS...`."""

import os
import signal
import sys

import flashdapo.trainer.loop as loop
from flashdapo.config.cli import resolve_config

kill_step = int(sys.argv[1])
real_update = loop.update_actor
calls = {"n": 0}


def update_then_die(*args, **kwargs):
    calls["n"] += 1
    if calls["n"] == kill_step:  # a fresh run: the n-th update is step n
        os.kill(os.getpid(), signal.SIGKILL)
    return real_update(*args, **kwargs)


loop.update_actor = update_then_die
loop.train(resolve_config(sys.argv[2:], "kill_during_step"))

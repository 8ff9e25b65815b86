"""Run `flashdapo train ARGS` and send this process SIGINT (what Ctrl-C sends) as training step K starts: the run
finishes step K, saves its checkpoint and stops (`python interrupt_at_step.py K train ARGS...`; exit status 130)."""

import os
import signal
import sys

import flashdapo.trainer.loop as loop
from flashdapo.__main__ import main

stop_step = int(sys.argv[1])
real_step = loop.train_step


def step_with_ctrl_c(run, step):
    if step == stop_step:
        os.kill(os.getpid(), signal.SIGINT)
    return real_step(run, step)


loop.train_step = step_with_ctrl_c
sys.exit(main(sys.argv[2:]))

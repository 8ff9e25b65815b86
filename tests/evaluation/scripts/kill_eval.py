"""Run `flashdapo eval ARGS` and SIGKILL this process while it writes round K of samples.jsonl (after
writing the first bytes of the round's line): `python kill_eval.py K ARGS...`."""

import json
import os
import signal
import sys

import flashdapo.eval.store as store
from flashdapo.__main__ import main

kill_round = int(sys.argv[1])
real_append = store.SampleLog.append
calls = {"n": 0}


def append_then_die(self, results):
    calls["n"] += 1
    if calls["n"] == kill_round:
        with open(self.path, "a", encoding="utf-8") as f:  # a torn write: part of the line, no newline
            f.write(json.dumps(results[0].to_dict())[:40])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    real_append(self, results)


store.SampleLog.append = append_then_die
sys.exit(main(["eval", *sys.argv[2:]]))

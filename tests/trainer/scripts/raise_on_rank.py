"""Run `flashdapo train ARGS` and raise on one rank at one step, inside reward scoring or generation:
`python raise_on_rank.py reward|generate|reward-stall|reward-hang|reward-kill RANK STEP ARGS...` (under torchrun).
With reward-stall the other ranks wait 10 minutes in reward scoring at that step, as a rank waits in an
NCCL collective whose peer died (which, unlike gloo, does not notice). With reward-hang the rank does
not raise: it waits 10 minutes there itself, while the others go on to the next collective. With reward-kill
the rank SIGKILLs itself there (as the OOM killer would): it reports nothing, its peers lose it."""

import os
import signal
import sys
import time
from pathlib import Path

import flashdapo.trainer.loop as loop
import flashdapo.trainer.setup as run
from flashdapo.__main__ import main

where, bad_rank, bad_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ.get("RANK", 0))
run_dir = Path(sys.argv[sys.argv.index("--logging.run-dir") + 1])
run_dir.mkdir(parents=True, exist_ok=True)
(run_dir / f"pid_{rank}").write_text(str(os.getpid()))  # the test checks that no rank outlives the job
current = {"step": 0}
real_step, real_verifier, real_engine = loop.train_step, run.get_verifier, run.training_engine


def counting_step(r, step):
    current["step"] = step
    return real_step(r, step)


def fail_here(what: str) -> None:
    if current["step"] != bad_step:
        return
    if rank == bad_rank:
        (run_dir / "failed_at").write_text(repr(time.time()))
        if where == "reward-hang":
            time.sleep(600)
        if where == "reward-kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure in {what} on rank {rank} at step {bad_step}")
    if where == "reward-stall":
        time.sleep(600)


def verifier(name):
    inner = real_verifier(name)

    def score(text, truth):
        fail_here("reward scoring")
        return inner(text, truth)

    return score


def engine(*args, **kwargs):
    built = real_engine(*args, **kwargs)
    generate = built.generate

    def failing_generate(prompts, sampling):
        fail_here("generation")
        return generate(prompts, sampling)

    built.generate = failing_generate
    return built


loop.train_step = counting_step
if where.startswith("reward"):
    run.get_verifier = verifier
else:
    run.training_engine = engine
sys.exit(main(["train", *sys.argv[4:]]))

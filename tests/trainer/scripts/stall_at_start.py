"""Run `flashdapo train ARGS` with rank RANK stalling SECONDS at the start-up checks (before the storage
check), as a rank stuck on a slow mount or started late would: `python stall_at_start.py RANK SECONDS ARGS...`
(under torchrun). Each rank writes its pid to RUN_DIR/pid_<rank> (the test checks no rank outlives the job)."""

import os
import sys
import time
from pathlib import Path

import flashdapo.trainer.state.startup as startup
from flashdapo.__main__ import main

bad_rank, seconds = int(sys.argv[1]), float(sys.argv[2])
rank = int(os.environ.get("RANK", 0))
run_dir = Path(sys.argv[sys.argv.index("--logging.run-dir") + 1])
run_dir.parent.mkdir(parents=True, exist_ok=True)
(run_dir.parent / f"pid_{rank}").write_text(str(os.getpid()))
real_check = startup.check_shared_storage


def stalling_check(*args, **kwargs):
    if rank == bad_rank:
        time.sleep(seconds)
    return real_check(*args, **kwargs)


startup.check_shared_storage = stalling_check
sys.exit(main(["train", *sys.argv[3:]]))

"""A launcher in miniature, as torchrun's agent is to its ranks: it hosts the rendezvous store and starts two
ranks in sessions of their own (a SIGKILL of the launcher leaves them running), each watching the store through
fail-fast with its split placement role.

    python launcher_killed.py              the launcher: prints its pid, starts the ranks, sleeps
    python launcher_killed.py RANK ROLE    a rank: prints 'ready RANK PID', then waits to be ended
"""

import datetime
import os
import subprocess
import sys
import time

import torch.distributed as dist

from flashdapo.distributed.failfast import FailFast

if len(sys.argv) == 1:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    print(f"launcher {os.getpid()}", flush=True)
    for rank, role in ((0, "trainer rank 0"), (1, "rollout rank 0")):
        subprocess.Popen([sys.executable, __file__, str(rank), role], env=env, start_new_session=True)
    time.sleep(120)
else:
    rank, role = int(sys.argv[1]), sys.argv[2]
    failfast = FailFast.connect(rank, 2, poll_s=0.2, role=role)
    failfast.watch()
    print(f"ready {rank} {os.getpid()}", flush=True)
    time.sleep(120)
    print(f"rank {rank} was never stopped", flush=True)

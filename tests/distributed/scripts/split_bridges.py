"""torchrun script: split placement's partitions and bridges (T trainer ranks, 1 rollout rank). Each rank
writes what it saw to OUT/rank{r}.json. `mode`: ok (collectives and bridges), fail_trainer / fail_rollout (that
side's last rank raises after the bridges are up), hang (the rollout rank stops answering while trainer rank 0
waits for a key)."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flashdapo.distributed.collectives import all_reduce
from flashdapo.distributed.failfast import FailFast
from flashdapo.distributed.mesh import init_distributed
from flashdapo.distributed.roles import Liveness

out, mode = Path(sys.argv[1]), sys.argv[2]
env = init_distributed("cpu", 60, 1, rollout_ranks=1)
b = env.bridges
b.stale_s = 3.0
failfast = FailFast.connect(env.global_rank, env.global_world_size, poll_s=0.2,
                            role=f"{env.role} rank {env.rank}")
failfast.watch()
live = Liveness(b.store, env.global_rank, every_s=0.2)
seen = {"role": env.role, "rank": env.rank, "world": env.world_size, "global": env.global_rank,
        "main": env.is_main, "partition_sum": all_reduce(torch.tensor([env.global_rank])).item(),
        "default_world": dist.get_world_size()}
try:
    if mode.startswith("fail_") and env.role == mode.removeprefix("fail_") and env.rank == env.world_size - 1:
        raise RuntimeError(f"injected failure on the {env.role} side")
    if mode == "hang" and env.role == "rollout":
        live.close()  # its liveness counter stops: as a stopped process's would
        time.sleep(120)
    rollout0 = b.layout.trainers
    if env.role == "rollout":
        time.sleep(1.0)  # the trainer polls meanwhile
        b.set("batch/1/ready", "1")
        b.send_bytes(b"hello from the rollout side", dst=0, tag=1)
        w = torch.zeros(5)
        b.broadcast_weights(w)
        seen["weights"] = w.tolist()
    else:
        if env.rank == 0:
            seen["waited_s"] = b.wait_key("batch/1/ready", [rollout0], "batch 1")
            seen["payload"] = b.recv_bytes(rollout0, tag=1).decode()
            b.broadcast_weights(torch.arange(5, dtype=torch.float32))
    failfast.close()
    live.close()
    (out / f"rank{env.global_rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()
except BaseException as err:
    failfast.fail(err)
    raise

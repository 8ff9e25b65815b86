"""torchrun script: global dynamic sampling over ranks with a scripted scorer. Writes rank_R.json."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripted import PlainTokenizer, ScriptedEngine, numbered_prompts, scripted_verifier  # noqa: E402

from flashdapo.config import merge, toy  # noqa: E402
from flashdapo.data import PromptSampler  # noqa: E402
from flashdapo.distributed.mesh import init_distributed, shutdown  # noqa: E402
from flashdapo.profiling import StageTimer
from flashdapo.trainer.collect.rounds import collect_groups  # noqa: E402

out = Path(sys.argv[1])
cfg = merge(toy(), {"rollout": {"n": 4}, "trainer": {"train_batch": 4, "gen_batch": 4, "mini_batch": 2}})
env = init_distributed("cpu")
# Global batches in order: round 1 = prompts 0-3 (rank 0: 0, 1; rank 1: 2, 3), round 2 = 4-7, ...
# Informative groups fall unevenly: all of them on rank 0's shards.
sampler = PromptSampler(numbered_prompts(16), cfg.trainer.gen_batch, seed=0, shuffle=False, rank=env.rank,
                        world_size=env.world_size)
collected = collect_groups(1, sampler, ScriptedEngine(), PlainTokenizer(), scripted_verifier({0, 1, 4, 5, 9}),
                           cfg, env, StageTimer(env.device))
(out / f"rank_{env.rank}.json").write_text(json.dumps({
    "rounds": collected.num_gen_batches,
    # Per mini-batch, the (prompt, response in its group) pairs this rank was dealt.
    "kept": [[[int(g.prompt[0]), m] for g in part for m in g.member_indices] for part in collected.mini_batches],
    "informative": collected.groups_informative,
}))
shutdown()
